"""A mixture-of-experts layer's pair GEMVs at one token (ops/fused_moe_gemv.py), as a decode
step runs them (the norm before finished in gate/up, the residual add and the next norm in
the last kernel), over the gate/up tiles with the down GEMV at its default, then over the
down GEMV's tiles and splits of k with gate/up at its default; bf16 on random weights in
Qwen3-30B-A3B's or Mixtral-8x7B's expert shapes. Each time is a CUDA-graph replay of 24 calls
whose chosen experts differ call to call (random, as a step's layers choose), so that the
experts a call reads are not left in the L2 by the call before.

    PYTHONPATH=. python benchmarks/gpu_moe_tile_sweep.py [--shape qwen3-30b-a3b]
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
from gpu_dense_gemv_sweep import CALLS, time_us  # a sibling script
from kvserve.ops.expert_weights import ExpertWeights
from kvserve.ops.fused_moe_gemv import GemvTile, default_tile, down_splits, experts_gemv_add_norm
from kvserve.ops.pending_norm import PendingNorm

SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}
GATE_UP_TILES = [(8, 256, 4), (4, 512, 4), (8, 512, 4), (4, 256, 4), (16, 256, 4), (4, 1024, 4), (2, 512, 4),
                 (8, 128, 4), (8, 256, 8), (4, 512, 2), (2, 1024, 4)]
DOWN_TILES = [(8, 256, 4), (4, 256, 4), (8, 128, 4), (16, 256, 4), (4, 512, 4), (8, 512, 4), (16, 128, 4),
              (8, 256, 2), (32, 256, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b", help="Expert shape.")
    args = parser.parse_args()
    num_experts, top_k, hidden, intermediate = SHAPES[args.shape]
    torch.manual_seed(0)
    dtype = torch.bfloat16
    w13 = ExpertWeights(torch.randn(num_experts, 2 * intermediate, hidden, device="cuda", dtype=dtype) / hidden**0.5)
    w2 = ExpertWeights(torch.randn(num_experts, hidden, intermediate, device="cuda", dtype=dtype)
                       / intermediate**0.5)
    chosen = [torch.randperm(num_experts, device="cuda")[:top_k].to(torch.int32)[None] for _ in range(CALLS)]
    weights = torch.softmax(torch.randn(1, top_k, device="cuda"), dim=-1)
    x = PendingNorm(torch.randn(1, hidden, device="cuda", dtype=dtype),
                    torch.full((1, 256), hidden / 256, device="cuda"), 1e-6)
    residual = torch.randn(1, hidden, device="cuda", dtype=dtype)
    norm_weight = torch.ones(hidden, device="cuda", dtype=dtype)
    megabytes = top_k * 3 * hidden * intermediate * 2 / 1e6

    def layer(i: int, gate_up: GemvTile, down: GemvTile, splits: int | None = None) -> None:
        experts_gemv_add_norm(x, chosen[i], weights, w13, w2, residual, norm_weight, gate_up, down, splits)

    gate_up_default, down_default = default_tile(w13), default_tile(w2)
    print(torch.cuda.get_device_name(), args.shape, f"{megabytes:.1f} MB a call; defaults: gate/up",
          tuple(gate_up_default), "down", tuple(down_default), "splits",
          down_splits(top_k, hidden, intermediate, down_default, torch.device("cuda")))
    for tile in map(GemvTile._make, GATE_UP_TILES):
        print(f"  gate/up {tuple(tile)}: {timed(lambda i: layer(i, tile, down_default))}", flush=True)
    for tile in map(GemvTile._make, DOWN_TILES):
        line = f"  down {tuple(tile)}:"
        for splits in (None, 1, 2, 3):
            line += f" splits {splits or 'default'} {timed(lambda i: layer(i, gate_up_default, tile, splits))};"
        print(line, flush=True)


def timed(calls) -> str:
    """time_us's result, or the error of a shape the kernels do not take."""
    try:
        return f"{time_us(calls):6.2f} us"
    except Exception as error:  # noqa: BLE001 - one shape's failure should not end the sweep
        return type(error).__name__


if __name__ == "__main__":
    main()
