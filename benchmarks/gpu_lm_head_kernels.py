"""llama3-8b's LM head (128256 x 4096) at decode row counts: the bf16 head through cuBLAS
against an int8 per-channel copy on kvserve's weight-only kernels (the default config and
others), and the int8 gate/up (28672 x 4096) at one row, each timed inside a CUDA graph
over enough weight copies (>= 256 MB) that nothing comes from L2 (gpu_one_row_configs), with
the bytes floor at the measured copy bandwidth. GPU only:

    python benchmarks/gpu_lm_head_kernels.py [--rows 1,4,16]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from gpu_one_row_configs import MIN_BYTES, graph_us
from kvserve.benchmarks.roofline import copy_bandwidth
from kvserve.quantization.int8 import quantize_int8
from kvserve.quantization.weight_only import LaunchConfig, default_config, weight_only_matmul

SHAPES = {"lm_head": (128256, 4096), "gate_up": (28672, 4096)}
INT8_CONFIGS = [LaunchConfig(1, 32, 256), LaunchConfig(1, 64, 256), LaunchConfig(1, 16, 256),
                LaunchConfig(1, 32, 128), LaunchConfig(16, 64, 128), LaunchConfig(16, 128, 128),
                LaunchConfig(16, 64, 256)]


def label(config: LaunchConfig | None) -> str:
    return "default" if config is None else f"{config.block_m}x{config.block_n}x{config.block_k}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16", help="Comma-separated row counts for the head.")
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; us a call")
    for name, (n, k) in SHAPES.items():
        copies = max(1, -(-MIN_BYTES // (n * k)))
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]
        int8 = [quantize_int8(w) for w in dense]
        for rows in [int(r) for r in args.rows.split(",")] if name == "lm_head" else [1]:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            reference = F.linear(x.double(), (int8[0][0].double() * int8[0][1].double()[:, None]))
            bf16_us = graph_us([lambda w=w: F.linear(x, w) for w in dense])
            print(f"{name} {n}x{k} rows {rows}: bf16 cuBLAS {bf16_us:.1f} (floor {2 * n * k / bandwidth * 1e6:.1f}); "
                  f"int8 floor {n * k / bandwidth * 1e6:.1f}; default config "
                  f"{label(default_config(rows, False, False, n))}")
            for config in [None, *INT8_CONFIGS]:
                if config is not None and config.block_m == 1 and rows > 1:  # one-row kernels
                    continue
                y = weight_only_matmul(x, int8[0][0], int8[0][1][:, None], None, k, config=config)
                error = ((y.double() - reference).abs().amax() / reference.abs().amax()).item()
                us = graph_us([lambda q=q, s=s: weight_only_matmul(x, q, s[:, None], None, k, config=config)
                               for q, s in int8])
                print(f"  int8 {label(config):>12}: {us:7.1f} us  ({n * k / us / 1e6:.2f} TB/s, rel err {error:.1e})")


if __name__ == "__main__":
    main()
