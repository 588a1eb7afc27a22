"""The few-token mixture-of-experts paths on one GPU: the pair GEMVs (ops/fused_moe_gemv.py)
over candidate tiles against the grouped GEMMs with their tuned tiles, on random weights in
Mixtral-8x7B's and Qwen3-30B-A3B's expert shapes, bf16 and int4 (128-wide groups). Each
time is one layer's experts, the median of CUDA-graph replays of 20 calls; GB/s counts the
expert bytes a call must read (each chosen expert once).

    PYTHONPATH=. python benchmarks/gpu_moe_gemv_sweep.py [--tokens 1 2 4]
"""

from __future__ import annotations

import argparse

import torch

from kvserve.benchmarks.graph_timing import replay_us
from kvserve.ops.expert_weights import ExpertWeights, weight_format
from kvserve.ops.fused_moe import fused_experts
from kvserve.ops.fused_moe_configs import config_for
from kvserve.ops.fused_moe_gemv import GemvTile, experts_gemv, uses_gemv

SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}
TILES = [GemvTile(n, k, w) for n, k, w in
         ((16, 256, 4), (32, 256, 4), (64, 256, 4), (32, 128, 4), (32, 512, 4), (16, 512, 4), (64, 256, 8),
          (8, 512, 4))]


def experts(num: int, rows: int, cols: int, fmt: str) -> ExpertWeights:
    if fmt == "bf16":
        return ExpertWeights(torch.randn(num, rows, cols, device="cuda", dtype=torch.bfloat16) / cols**0.5)
    packed = torch.randint(0, 256, (num, rows, cols // 2), dtype=torch.uint8, device="cuda")
    scale = torch.rand(num, rows, cols // 128, device="cuda") / 64
    return ExpertWeights(packed, scale, -8 * scale, 128, True)


def time_us(call, repeats: int = 20, rounds: int = 7) -> float:
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            call()
    return replay_us(graph, repeats, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4], help="Token counts (default: 1 2 4).")
    args = parser.parse_args()
    for name, (num_experts, top_k, hidden, intermediate) in SHAPES.items():
        for fmt in ("bf16", "int4"):
            w13 = experts(num_experts, 2 * intermediate, hidden, fmt)
            w2 = experts(num_experts, hidden, intermediate, fmt)
            expert_bytes = sum(t.numel() * t.element_size() for w in (w13, w2)
                               for t in (w.weight, w.scale, w.offset) if t is not None) / num_experts
            for tokens in args.tokens:
                x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
                chosen = torch.stack([torch.randperm(num_experts, device="cuda")[:top_k] for _ in range(tokens)])
                weights = torch.softmax(torch.randn(tokens, top_k, device="cuda"), dim=-1)
                read = expert_bytes * chosen.unique().numel()
                config = config_for(tokens, num_experts, hidden, intermediate,
                                    weight_format(w13, torch.bfloat16), x.device)
                grouped = time_us(lambda: fused_experts(x, chosen, weights, w13, w2, config))
                print(f"{name} {fmt} tokens {tokens} (gemv by default: {uses_gemv(tokens * top_k, num_experts, top_k)})"
                      f": grouped {grouped:7.1f} us {read / grouped / 1e3:6.0f} GB/s")
                for tile in TILES:
                    try:
                        us = time_us(lambda: experts_gemv(x, chosen, weights, w13, w2, tile, tile))
                    except Exception as error:  # a tile that does not fit the format
                        print(f"   gemv {tuple(tile)}: {type(error).__name__}")
                        continue
                    print(f"   gemv {tuple(tile)}: {us:7.1f} us {read / us / 1e3:6.0f} GB/s")


if __name__ == "__main__":
    main()
