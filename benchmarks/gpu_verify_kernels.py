"""Where a speculative verify step's extra device time goes, by kernel: the engine's CUDA
graphs for a plain decode step (1 token) and a verify step (1 + k tokens) of one sequence,
each replayed N times under torch.profiler, kernel time a step by name side by side.
llama3-8b dummy weights.

    python benchmarks/gpu_verify_kernels.py [--quantization int4|fp8] [-k 4] [--context-len 256]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_step_kernels import kernel_totals, print_kernel_diff  # benchmarks/ is the script's directory
from kvserve.llm import LLM


def graph_kernels(graph: torch.cuda.CUDAGraph, replays: int) -> dict[str, list[float]]:
    """kernel_totals of `replays` replays of the graph."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return kernel_totals(prof)


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
    print_kernel_diff(("plain", "verify"), plain, verify, args.replays)


if __name__ == "__main__":
    main()
