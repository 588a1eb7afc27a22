"""Which kernels make a served decode step longer than its graph replayed back to back
(`bench latency`'s "graph p50" against "GPU ms" at batch 64): llama3-8b dummy weights, CUDA
graphs on; the decode steps of a served run (a run of N + 1 tokens minus a prefill-only
run) and the last step's graph replayed N times, both profiled with torch.profiler, by
kernel name.

    python benchmarks/gpu_served_vs_replayed.py [--quantization fp8] [--batch 64] [--steps 64]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_step_kernels import kernel_totals, print_kernel_diff  # benchmarks/ is the script's directory
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


def _served(llm: LLM, prompts: list[dict], max_tokens: int) -> dict[str, list[float]]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
    return kernel_totals(prof)


def _print_replay_forms(graph: torch.cuda.CUDAGraph, repeats: int) -> None:
    """The graph's device time replayed four ways: back to back (bench latency's "GPU
    ms"; and with events around each replay), one replay at a time after a synchronize, and one at a time after the host slept
    2 ms with the GPU idle (events around each replay, as "graph p50" times them)."""
    import statistics
    import time

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    forms = {"back to back": start.elapsed_time(end) / repeats}
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for first, last in pairs:
        first.record()
        graph.replay()
        last.record()
    pairs[-1][1].synchronize()
    forms["back to back, events around each"] = statistics.median(a.elapsed_time(b) for a, b in pairs)
    for name, sleep in (("one at a time", 0.0), ("after 2 ms idle", 0.002)):
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            time.sleep(sleep)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        forms[name] = statistics.median(times)
    print("graph replayed " + ", ".join(f"{name}: {ms:.3f} ms" for name, ms in forms.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", default="llama3-8b", help="Dummy model shape.")
    parser.add_argument("--quantization", default=None, help="Weight method, or none for bf16.")
    parser.add_argument("--batch", type=int, default=64, help="Sequences decoded together.")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens per request.")
    parser.add_argument("--steps", type=int, default=64, help="Decode steps served, and replays.")
    args = parser.parse_args()
    llm = LLM(load_format="dummy", model_shape=args.model_shape, quantization=args.quantization,
              max_num_seqs=args.batch)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(args.input_len)]}
               for i in range(args.batch)]
    _served(llm, prompts, args.steps + 1)  # warm-up: graphs captured, kernels compiled
    served = _served(llm, prompts, args.steps + 1)
    for name, (calls, us) in _served(llm, prompts, 1).items():
        served[name][0] -= calls
        served[name][1] -= us
    graphs = llm.engine.runner.cuda_graphs
    graph = graphs.graphs[graphs.last_key].graph
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            graph.replay()
        torch.cuda.synchronize()
    replayed = kernel_totals(prof)
    steps = args.steps
    _print_replay_forms(graph, steps)
    print(f"{args.quantization or 'bf16'}, batch {args.batch}, graph {graphs.last_key}: us a step "
          f"(served: {steps} decode steps; replayed: the last graph {steps} times)")
    print_kernel_diff(("replayed", "served"), replayed, served, steps)


if __name__ == "__main__":
    main()
