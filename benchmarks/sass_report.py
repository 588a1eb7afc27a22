"""Registers and the main loop's instruction mix of kvserve's one-row/few-row GEMV kernels,
compiled for sm_90 on any machine (Triton's own ptxas, cuobjdump and nvdisasm; no GPU): the
instruction counts BENCHMARKS.md quotes.

    python benchmarks/sass_report.py [int4-fma|int4-mma|fp8-mma] [--warps 4] [--row-tiles 2] [--x-tiles 1]
"""

from __future__ import annotations

import argparse
import collections
import re

from kvserve.quantization.weight_only import mma, words
from kvserve.triton_offline import compile_kernel, cuda_tool, resource_usage


def report(compiled) -> str:
    registers, stack = resource_usage(compiled)
    sass = cuda_tool("nvdisasm", compiled.asm["cubin"], "-c")
    addresses = {}  # label -> address of its first instruction
    lines = []
    label = None
    for line in sass.splitlines():
        if match := re.match(r"\s*(\.L_x_\d+):", line):
            label = match.group(1)
        elif match := re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            address = int(match.group(1), 16)
            lines.append((address, match.group(2)))
            if label:
                addresses[label], label = address, None
    loops = [(addresses[m.group(1)], address) for address, text in lines
             if (m := re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)) and addresses.get(m.group(1), address) < address]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
                                  for address, text in lines if start <= address <= end)
    mix = ", ".join(f"{op} {count}" for op, count in opcodes.most_common(12))
    return (f"{registers} registers, {stack} bytes of stack; main loop "
            f"{sum(opcodes.values())} instructions: {mix}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", nargs="?", default="int4-mma", choices=("int4-fma", "int4-mma", "fp8-mma"))
    parser.add_argument("--warps", type=int, default=4, help="num_warps.")
    parser.add_argument("--row-tiles", type=int, default=2, help="mma kernels: 16-row tiles a warp.")
    parser.add_argument("--x-tiles", type=int, default=1, help="mma kernels: 8-row tiles of x (1, 2, 4, 8).")
    args = parser.parse_args()
    if args.kernel == "int4-fma":  # the production one-row config, 1x128x256
        compiled = compile_kernel(words.int4_gemv_kernel, dict(X_BF16=True, HAS_OFFSET=True, SPLIT=True, BLOCK_M=1,
                                                       BLOCK_N=128, BLOCK_K=256, TWO_GROUPS=True, PDL=True),
                            args.warps)
    elif args.kernel == "int4-mma":
        compiled = compile_kernel(mma.int4_mma_kernel, dict(FP16=False, HAS_OFFSET=True, SPLIT=True,
                                                      ROW_TILES=args.row_tiles, NUM_WARPS=args.warps, X_TILES=args.x_tiles),
                            args.warps)
    else:
        compiled = compile_kernel(mma.fp8_mma_kernel, dict(X_BF16=True, SPLIT=True, ROW_TILES=args.row_tiles,
                                                     NUM_WARPS=args.warps, X_TILES=args.x_tiles), args.warps)
    tiles = f", {args.row_tiles} row tiles, {args.x_tiles} x tiles" if args.kernel != "int4-fma" else ""
    shared = ", shared memory" if "local_alloc" in compiled.asm["ttgir"] else ""
    print(f"{args.kernel} (sm_90, {args.warps} warps{tiles}{shared}): {report(compiled)}")


if __name__ == "__main__":
    main()
