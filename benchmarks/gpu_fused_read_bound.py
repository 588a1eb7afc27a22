"""How much a decode step could gain by reading several linears' weights in one kernel: the
time of a plain streaming read (gpu_read_ceiling.read_us: the best of a small grid, CUDA
graphs over copies) of each of llama3-8b's linears alone, summed over a layer, against one
read of the MLP's bytes (gate/up + down) and of the whole layer's, and the read bandwidth of
1 GB. A persistent kernel that ran several linears would read at best at the fused rate.

    python benchmarks/gpu_fused_read_bound.py [--format int4|fp8]
"""

from __future__ import annotations

import argparse

import torch

from gpu_one_row_configs import SHAPES
from gpu_read_ceiling import read_us


def linear_bytes(fmt: str, n: int, k: int) -> int:
    return n * k // 2 + n * (k // 128) * 8 if fmt == "int4" else n * k + n * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="fp8", choices=("int4", "fp8"), help="The weights' format.")
    fmt = parser.parse_args().format
    print(torch.cuda.get_device_name(), fmt, "plain reads, us a call (CUDA graph over copies)", flush=True)
    sizes = {name: linear_bytes(fmt, n, k) for name, (n, k) in SHAPES.items()}
    alone = {}
    for name, nbytes in sizes.items():
        alone[name], how = read_us(nbytes)
        print(f"{name:8s} {nbytes / 1e6:7.1f} MB {alone[name]:7.2f} us ({nbytes / alone[name] / 1e6:.2f} TB/s; {how})",
              flush=True)
    for label, names in (("mlp", ("gate_up", "down")), ("layer", tuple(sizes))):
        nbytes = sum(sizes[n] for n in names)
        fused, how = read_us(nbytes)
        apart = sum(alone[n] for n in names)
        print(f"{label:8s} {nbytes / 1e6:7.1f} MB one read {fused:7.2f} us ({nbytes / fused / 1e6:.2f} TB/s; {how}); "
              f"apart {apart:7.2f} us: {apart - fused:.2f} us a layer, {32 * (apart - fused) / 1e3:.3f} ms a step",
              flush=True)
    big, how = read_us(1 << 30)
    print(f"1 GB     one read {big:8.1f} us ({(1 << 30) / big / 1e6:.2f} TB/s; {how})", flush=True)


if __name__ == "__main__":
    main()
