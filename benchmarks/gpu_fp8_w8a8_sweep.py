"""fp8 linears at decode rows (2-256): kvserve's split-K W8A8 kernel (fp8_w8a8) over a
grid of tiles (at up to 32 rows also row tiles of 16 and 32 in the MMA's N slot, swap_ab), against what runs there now: `torch._scaled_mm` (row-wise scales, fast
accumulation) above 64 rows, the weight-only kernels at up to 64 (at up to 32 the mma.sync
one with 4 tiles of x too); both W8A8 forms after the
per-token quantization, timed with it and alone. llama3-8b's four linears, one step's 32
layers, each output checked against the fp64 product of the same fp8 operands. GPU only:


    python benchmarks/gpu_fp8_w8a8_sweep.py [--rows 64,96,128,192,256]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench

from kvserve.ops.quant.fp8_activation import quantize_per_token
from kvserve.ops.quant.fp8_w8a8 import fp8_w8a8_matmul
from kvserve.ops.quant.weight_only import LaunchConfig, default_config, weight_only_matmul
from kvserve.quantization.fp8 import quantize_fp8

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
# The fp8 mma.sync weight-only kernel with all 32 rows in a program (4 tiles of x).
MMA_32 = LaunchConfig(32, 128, 128, num_warps=4, num_stages=1, waves=2, words="mma")

TILES = [(64, 64, 256, 4, 3), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 64, 128, 4, 4),
         (128, 64, 128, 8, 4), (128, 128, 128, 8, 3)]
CONFIGS = [LaunchConfig(*tile, waves=waves) for tile, waves in itertools.product(TILES, (1, 2, 4))]
# Narrow row tiles (swap_ab: the weight's columns fill wgmma's 64-wide M).
SMALL_TILES = [(16, 64, 256, 4, 3), (16, 128, 128, 4, 3), (16, 128, 256, 4, 3), (16, 64, 128, 4, 4),
               (32, 64, 256, 4, 3), (32, 128, 128, 4, 3)]
SMALL_CONFIGS = [LaunchConfig(*tile, waves=waves) for tile, waves in itertools.product(SMALL_TILES, (1, 2, 4))]


def us(fn) -> float:
    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    return (y.double() - ref).abs().max().item() / ref.abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="17,24,32,48,64,96,128,160", help="Comma-separated row counts (default: 17,24,32,48,64,96,128,160).")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "| us per call; step = 32 layers x 4 linears, ms")
    for m in (int(r) for r in args.rows.split(",")):
        step: dict[str, float] = {}
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            wq, sw = quantize_fp8(w)
            xq, sx = quantize_per_token(x)
            ref = (xq.double() * sx.double()) @ (wq.double() * sw.double()[:, None]).t()
            row: dict[str, float] = {"quant": us(lambda: quantize_per_token(x))}
            scaled = lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.view(1, -1),  # noqa: E731
                                              out_dtype=torch.bfloat16, use_fast_accum=True)
            row["scaled_mm"] = us(scaled)
            err = {"scaled_mm": relative(scaled(), ref)}
            if m <= 64:
                config = default_config(m, False, True, n)
                only = lambda: weight_only_matmul(x, wq, sw[:, None], None, k, config=config)  # noqa: E731
                row["weight_only(x bf16)"] = us(only)
            if m <= 32:
                mma = lambda: weight_only_matmul(x, wq, sw[:, None], None, k, config=MMA_32)  # noqa: E731
                row["weight_only mma"] = us(mma)
            results = []
            configs = (SMALL_CONFIGS if m <= 32 else []) + (CONFIGS if m > 16 else CONFIGS[:1])
            for config in configs:
                if config.block_m > max(m, 64) or k % config.block_k:
                    continue
                fn = lambda: fp8_w8a8_matmul(xq, sx, wq, sw, config)  # noqa: E731
                try:
                    e = relative(fn(), ref)
                except Exception as exc:  # noqa: BLE001 (shared memory, registers)
                    print(f"  {config} failed: {type(exc).__name__}")
                    continue
                results.append((us(fn), config, e))
            results.sort(key=lambda r: r[0])
            t, config, e = results[0]
            row["w8a8 best"] = t
            err["w8a8"] = e
            floor = n * k / 3.0e6  # us at 3.0 TB/s
            print(f"m {m:4d} {name:8s} " + " ".join(f"{key} {v:.1f}" for key, v in row.items())
                  + f" | floor {floor:.1f} | err " + " ".join(f"{key} {v:.1e}" for key, v in err.items())
                  + f" | best {config} | next: " + "; ".join(f"{r[1]} {r[0]:.1f}" for r in results[1:4]),
                  flush=True)
            for key, v in row.items():
                step[key] = step.get(key, 0.0) + v * LAYERS / 1e3
        print(f"m {m:4d} STEP " + " ".join(f"{key} {v:.2f}" for key, v in step.items())
              + f" | scaled_mm+quant {step['scaled_mm'] + step['quant']:.2f}"
              + f" | w8a8+quant {step['w8a8 best'] + step['quant']:.2f}", flush=True)


if __name__ == "__main__":
    main()
