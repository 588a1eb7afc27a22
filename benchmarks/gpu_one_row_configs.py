"""One row of x against llama3-8b's linears, int4 g128 and fp8: every kernel config in a
grid wider than the sweep tool's (split-K counts included), each timed inside a CUDA graph
that cycles through enough copies of the weight (>= 256 MB) that nothing comes from L2, and
checked against the default config's output. Prints each linear's configs, fastest first,
and the step's linears with the default and with the best config per linear. GPU only:

    python benchmarks/gpu_one_row_configs.py [--formats int4,fp8] [--top 6]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from kvserve.ops.quant.weight_only import LaunchConfig, default_config, weight_only_matmul

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
MIN_BYTES = 256 << 20


def configs(fmt: str) -> list[LaunchConfig]:
    block_k = 256 if fmt == "int4" else 128
    splits = [(2, None), (4, None), (8, None), (1, None), (2, 1)]
    out = [LaunchConfig(8, bn, block_k, num_warps=w, num_stages=1, waves=waves, words="mma", split_k=split)
           for bn, w in ((128, 4), (64, 2), (64, 4), (32, 2), (256, 8), (128, 8)) for waves, split in splits]
    if fmt == "int4":
        out += [LaunchConfig(1, bn, 256, num_warps=w, num_stages=1, waves=waves, words="fma", split_k=split)
                for bn, w in ((128, 4), (64, 4), (32, 4), (64, 2)) for waves, split in splits[:2] + splits[-1:]]
    else:
        out += [LaunchConfig(1, bn, 256, waves=waves, split_k=split)
                for bn in (16, 32, 64) for waves, split in splits[:2] + splits[-1:]]
        out += [LaunchConfig(1, 64, 256, num_stages=1, waves=4, words="fma")]
    return out


def label(config: LaunchConfig) -> str:
    split = "" if config.split_k is None else f" split{config.split_k}"
    return (f"{config.words or 'byte'} {config.block_m}x{config.block_n}x{config.block_k} "
            f"warps{config.num_warps} waves{config.waves}{split}")


def weights(fmt: str, n: int, k: int, copies: int) -> list[tuple]:
    out = []
    for _ in range(copies):
        if fmt == "int4":
            q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
            scale = torch.rand(n, k // 128, device="cuda") / 100
            out.append((q, scale, -8 * scale, 128, True))
        else:
            q = (torch.randn(n, k, device="cuda") * 64).to(torch.float8_e4m3fn)
            out.append((q, torch.rand(n, 1, device="cuda") / 100, None, k, False))
    return out


def graph_us(calls: list) -> float:
    """us per call, averaged over one replay of a CUDA graph that makes every call once (each
    is run once outside the capture first: Triton compiles there)."""
    for call in calls:
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return do_bench(graph.replay, warmup=5, rep=100, return_mode="median") * 1e3 / len(calls)


def time_config(x: torch.Tensor, stored: list[tuple], config: LaunchConfig | None) -> float:
    """us per call of one config over every weight copy (graph_us)."""
    return graph_us([lambda q=q, scale=scale, offset=offset, group=group, four_bit=four_bit:
                     weight_only_matmul(x, q, scale, offset, group, four_bit, config=config)
                     for q, scale, offset, group, four_bit in stored])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="int4,fp8", help="Comma-separated formats: int4, fp8 (default: int4,fp8).")
    parser.add_argument("--top", type=int, default=6, help="Configs listed per linear (default: 6).")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "one row, us a call (CUDA graph over weight copies)")
    for fmt in args.formats.split(","):
        default_total = best_total = 0.0
        for name, (n, k) in SHAPES.items():
            nbytes = n * k // (2 if fmt == "int4" else 1)
            stored = weights(fmt, n, k, max(2, -(-MIN_BYTES // nbytes)))
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            q, scale, offset, group, four_bit = stored[0]
            reference = weight_only_matmul(x, q, scale, offset, group, four_bit).float()
            default = default_config(1, four_bit, not four_bit, n)
            rows = [(time_config(x, stored, None), "default: " + label(default))]
            for config in configs(fmt):
                y = weight_only_matmul(x, q, scale, offset, group, four_bit, config=config).float()
                error = ((y - reference).abs().max() / reference.abs().max()).item()
                bad = f"  WRONG {error:.1e}" if error > 2e-2 else ""
                rows.append((time_config(x, stored, config), label(config) + bad))
            rows.sort()
            default_us = next(us for us, text in rows if text.startswith("default"))
            default_total += default_us
            best_total += rows[0][0]
            print(f"{fmt} {name} ({n} x {k}, {nbytes / 1e6:.1f} MB; default {default_us:.2f} us):", flush=True)
            for us, text in rows[:args.top]:
                print(f"  {us:7.2f}  {text}", flush=True)
        print(f"{fmt} step's linears: default {default_total * LAYERS / 1e3:.3f} ms, best per linear "
              f"{best_total * LAYERS / 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
