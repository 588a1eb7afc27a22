"""Where a decode step's wall time goes on the GPU's timeline, CUDA graphs on (as served):
llama3-8b dummy weights, one request, profiled with torch.profiler (kernels, copies and
the host's runtime calls). Reports the device's busy and idle time per decode step, the
activities outside graphs, the idle gaps grouped by what ran before and after them (TPOT
minus the graph's own time is in those gaps and activities), and each kernel's cost inside
the PDL chain (kvserve/benchmarks/decode_timeline.py computes them).

    python benchmarks/gpu_decode_timeline.py [--quantization int4|fp8] [--batch 1] [--output-len 64]
        [--dump-steps 2 --skip-steps 20] [--num-loras 1 --lora-rank 16]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve.benchmarks.decode_timeline import (
    chain_costs,
    graph_launch_times,
    idle_report,
    step_timeline,
)
from kvserve.benchmarks.lora_throughput import random_adapters
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each flag's default."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--model-shape", default="llama3-8b", help="Dummy model shape.")
    parser.add_argument("--quantization", default=None, help="Weight-only method (int4, fp8, ...); unset runs bf16.")
    parser.add_argument("--batch", type=int, default=1, help="Sequences decoded together.")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens per request.")
    parser.add_argument("--output-len", type=int, default=64, help="Tokens decoded per request.")
    parser.add_argument("--skip-steps", type=int, default=8,
                        help="Decode steps left out at the start (prefill, first graph replays).")
    parser.add_argument("--layers", type=int, default=32, help="Decoder layers of the model shape.")
    parser.add_argument("--dump-steps", type=int, default=0,
                        help="Also print this many steps' host calls and non-graph device work in order.")
    parser.add_argument("--trace", default=None, help="Also keep the Chrome trace at this path.")
    parser.add_argument("--num-loras", type=int, default=0,
                        help="Serve this many random LoRA adapters, the requests spread over them.")
    parser.add_argument("--lora-rank", type=int, default=16, help="Rank of the random adapters.")
    args = parser.parse_args()
    lora = dict(enable_lora=True, max_loras=args.num_loras, max_lora_rank=args.lora_rank) if args.num_loras else {}
    llm = LLM(load_format="dummy", model_shape=args.model_shape, quantization=args.quantization,
              max_num_seqs=max(args.batch, 1), **lora)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(args.input_len)]}
               for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    adapters_dir = tempfile.mkdtemp()
    adapters = (random_adapters(adapters_dir, llm.engine.model_config, args.num_loras, args.lora_rank)
                if args.num_loras else [None])
    lora_requests = [adapters[i % len(adapters)] for i in range(args.batch)]
    llm.generate(prompts, params, lora_request=lora_requests)  # warm-up: graphs captured, kernels compiled
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, lora_request=lora_requests)
        torch.cuda.synchronize()
    path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    print_idle_report(events, args.output_len - 1, args.skip_steps)
    print_chain_costs(events, args.skip_steps, args.layers)
    if args.dump_steps:
        print_step_timeline(events, args.skip_steps, args.dump_steps)


def print_idle_report(events: list[dict], decode_steps: int, skip: int) -> None:
    print(f"{len(graph_launch_times(events))} graph launches, {decode_steps} decode steps expected")
    report = idle_report(events, skip)
    if report is None:
        print("too few graph launches to measure (graphs off?)")
        return
    steps = report.steps
    print(f"{steps} steps from graph launch {skip} to the last: {report.span_us / steps:.1f} us a step, "
          f"device busy {report.busy_us / steps:.1f} us, idle {(report.span_us - report.busy_us) / steps:.1f} us")
    print("activities outside graphs, per step:")
    for name, (n, us) in sorted(report.outside_graphs.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"  {n / steps:5.2f} calls  {us / steps:7.2f} us  {name[:80]}")
    print("idle gaps by (activity before, activity after), per step:")
    for (before, after), (n, us) in sorted(report.gaps.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"  {n / steps:5.2f} gaps  {us / steps:7.2f} us  {before[:50]}  ->  {after[:50]}")
    print("host runtime calls, per step:")
    for name, (n, us) in sorted(report.host_calls.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {n / steps:5.2f} calls  {us / steps:7.2f} us  {name}")


def print_chain_costs(events: list[dict], skip: int, layers: int) -> None:
    steps, costs = chain_costs(events, skip, layers)
    if not steps:
        return
    total = sum(sum(values) for values in costs.values()) / steps
    print(f"chain cost inside the graph, per step ({steps} steps): {total:.1f} us")
    for label, values in sorted(costs.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(values) / steps:8.1f} us/step  {len(values) / steps:5.1f} calls  "
              f"{sum(values) / len(values):6.2f} us/call  {label[:60]}")


def print_step_timeline(events: list[dict], skip: int, count: int) -> None:
    print(f"timeline of {count} steps, us from graph launch {skip}:")
    for offset, duration, side, what in step_timeline(events, skip, count):
        print(f"  {offset:9.1f} {duration:8.1f}  {side:4s}  {what[:76]}")


if __name__ == "__main__":
    main()
