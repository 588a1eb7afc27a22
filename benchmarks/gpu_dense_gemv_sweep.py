"""The one-row dense GEMV (kvserve/ops/dense_gemv.py) over its launch shapes (rows and k
columns a program, splits of K) against cuBLAS, for the decode projections of Qwen3-30B-A3B
and Llama-3-8B, bf16 on random weights. Each time is a CUDA-graph replay of 24 calls that
cycle through 8 copies of the weight (more than the L2 holds, as in a step where every layer
reads its own), per call; o_proj also as the fused-norm producer (gemv_add_norm), as a
mixture-of-experts layer runs it.

    PYTHONPATH=. python benchmarks/gpu_dense_gemv_sweep.py [--shapes N,K ...]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kvserve.benchmarks.graph_timing import replay_us
from kvserve.ops import dense_gemv
from kvserve.ops.pending_norm import PendingNorm

COPIES = 8
CALLS = 24
SHAPES = {"qwen3 q/k/v": (5120, 2048), "qwen3 o_proj": (2048, 4096), "llama3 q/k/v": (6144, 4096),
          "llama3 o_proj": (4096, 4096)}
TILES = [(8, 256, 1), (4, 512, 1), (8, 512, 1), (2, 512, 1), (4, 1024, 1), (2, 1024, 1), (4, 2048, 1), (4, 256, 2),
         (4, 512, 2), (8, 512, 2), (2, 512, 2), (4, 256, 4), (8, 256, 4), (16, 256, 4), (8, 128, 4)]


def time_us(calls) -> float:
    """Median over 7 replays of a graph of CALLS calls (calls(i) makes the i-th), per call;
    the first COPIES calls made once before, to compile and allocate."""
    for i in range(COPIES):
        calls(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            calls(i)
    return replay_us(graph, CALLS, rounds=7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", help="N,K pairs instead of the named projections.")
    args = parser.parse_args()
    shapes = {s: tuple(map(int, s.split(","))) for s in args.shapes} if args.shapes else SHAPES
    torch.manual_seed(0)
    dtype = torch.bfloat16
    print(torch.cuda.get_device_name(), "defaults:", {name: tuple(dense_gemv.tile(n, k, torch.device("cuda")))
                                                     for name, (n, k) in shapes.items()})
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(COPIES)]
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        expected = F.linear(x.float(), weights[0].float())
        megabytes = n * k * 2 / 1e6
        cublas = time_us(lambda i: F.linear(x, weights[i % COPIES]))
        print(f"{name} {n}x{k} ({megabytes:.1f} MB): cuBLAS {cublas:6.2f} us ({megabytes * 1e3 / cublas:5.0f} GB/s)")
        residual = torch.randn(1, n, device="cuda", dtype=dtype)
        norm_weight = torch.ones(n, device="cuda", dtype=dtype)
        pending = PendingNorm(x, torch.full((1, 512), float(k) / 512, device="cuda"), 1e-6)
        for tile in TILES:
            error = (dense_gemv.gemv(x, weights[0], block=tile).float() - expected).abs().max().item()
            plain = time_us(lambda i: dense_gemv.gemv(x, weights[i % COPIES], block=tile))
            line = f"  {tile}: {plain:6.2f} us ({megabytes * 1e3 / plain:5.0f} GB/s, err {error:.0e})"
            if "o_proj" in name:
                fused = time_us(lambda i: dense_gemv.gemv_add_norm(x, weights[i % COPIES], residual, norm_weight,
                                                                   block=tile))
                line += f"; add_norm {fused:6.2f} us"
            else:
                fused = time_us(lambda i: dense_gemv.gemv(pending, weights[i % COPIES], block=tile))
                line += f"; of a pending norm {fused:6.2f} us"
            print(line, flush=True)


if __name__ == "__main__":
    main()
