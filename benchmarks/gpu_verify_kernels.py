"""Where a speculative verify step's extra device time goes, by kernel: the engine's CUDA
graphs for a plain decode step (1 token) and a verify step (1 + k tokens) of one sequence,
each replayed N times under torch.profiler, kernel time a step by name side by side.
llama3-8b dummy weights.

    python benchmarks/gpu_verify_kernels.py [--quantization int4|fp8] [-k 4] [--context-len 256]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve.llm import LLM


def graph_kernels(graph: torch.cuda.CUDAGraph, replays: int) -> dict[str, float]:
    """us a replay by kernel name."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:80]] += event.device_time_total / replays
    return totals


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default=None, help="Weight method, or none for bf16.")
    parser.add_argument("-k", type=int, default=4, help="Drafted tokens a verify step checks.")
    parser.add_argument("--context-len", type=int, default=256, help="Tokens already in the cache.")
    parser.add_argument("--replays", type=int, default=20, help="Replays profiled per graph.")
    args = parser.parse_args()
    llm = LLM(load_format="dummy", model_shape="llama3-8b", quantization=args.quantization,
              speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
    runner = llm.engine.runner
    graphs = runner.cuda_graphs
    kernels = []
    for width in (1, 1 + args.k):
        table = list(range(-(-(args.context_len + width) // runner.block_size)))
        graphs.run([list(range(1000, 1000 + width))], [args.context_len], [table])
        kernels.append(graph_kernels(graphs.graphs[graphs.last_key].graph, args.replays))
    plain, verify = kernels
    print(f"{args.quantization or 'bf16'}: us a step by kernel, plain decode (1 token) and verify (1 + {args.k})")
    print(f"{'plain':>8} {'verify':>8} {'diff':>8}  kernel")
    for name in sorted(set(plain) | set(verify), key=lambda n: -(verify.get(n, 0) - plain.get(n, 0))):
        p, v = plain.get(name, 0.0), verify.get(name, 0.0)
        if max(p, v) >= 3.0:
            print(f"{p:8.1f} {v:8.1f} {v - p:8.1f}  {name}")
    print(f"{sum(plain.values()):8.1f} {sum(verify.values()):8.1f} {sum(verify.values()) - sum(plain.values()):8.1f}"
          "  all kernels")


if __name__ == "__main__":
    main()
