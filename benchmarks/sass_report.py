"""Registers and the main loop's instruction mix of kvserve's one-row/few-row GEMV kernels,
compiled for sm_90 on any machine (Triton's own ptxas, cuobjdump and nvdisasm; no GPU): what
a change to a kernel's loop costs in registers and instructions, before it is timed.

    python benchmarks/sass_report.py [int4-fma|int4-mma|fp8-mma] [--warps 4] [--row-tiles 2] [--x-tiles 1]
        [--one-row]
"""

from __future__ import annotations

import argparse
import collections
import re

from kvserve.ops.quant.weight_only import mma, words
from kvserve.ops.quant.weight_only.matmul import WORD_KERNEL_MAX_REGISTERS
from kvserve.ops.triton_offline import compile_kernel, main_loop, resource_usage


def report(compiled) -> str:
    registers, stack = resource_usage(compiled)
    opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
                                  for text in main_loop(compiled))
    mix = ", ".join(f"{op} {count}" for op, count in opcodes.most_common(12))
    return (f"{registers} registers, {stack} bytes of stack; main loop "
            f"{sum(opcodes.values())} instructions: {mix}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", nargs="?", default="int4-mma", choices=("int4-fma", "int4-mma", "fp8-mma"),
                        help="Kernel to compile: the int4 CUDA-core word kernel, or the int4 or fp8 "
                             "mma.sync kernel (default: int4-mma).")
    parser.add_argument("--warps", type=int, default=4, help="num_warps (default: 4).")
    parser.add_argument("--row-tiles", type=int, default=2, help="mma kernels: 16-row tiles a warp (default: 2).")
    parser.add_argument("--x-tiles", type=int, default=1,
                        help="mma kernels: 8-row tiles of x, 1, 2, 4 or 8 (default: 1).")
    parser.add_argument("--one-row", action="store_true",
                        help="Compile with M = 1, as Triton specializes a launch of one row of x.")
    args = parser.parse_args()
    if args.kernel == "int4-fma":  # the production one-row config, 1x128x256
        kernel, constexprs = words.int4_gemv_kernel, dict(X_BF16=True, HAS_OFFSET=True, SPLIT=True, BLOCK_M=1,
                                                          BLOCK_N=128, BLOCK_K=256, TWO_GROUPS=True, PDL=True, ROW_SCALE=False, PARTIALS=1,
                                                          ADD_NORM=False)
    elif args.kernel == "int4-mma":
        kernel, constexprs = mma.int4_mma_kernel, dict(FP16=False, HAS_OFFSET=True, SPLIT=True,
                                                       ROW_TILES=args.row_tiles, NUM_WARPS=args.warps,
                                                       X_TILES=args.x_tiles, LAUNCH_NEXT=True,
                                                       ROW_SCALE=False, PARTIALS=1)
    else:
        kernel, constexprs = mma.fp8_mma_kernel, dict(X_BF16=True, SPLIT=True, ROW_TILES=args.row_tiles,
                                                      NUM_WARPS=args.warps, X_TILES=args.x_tiles, PDL=True,
                                                      ROW_SCALE=False, PARTIALS=1, ADD_NORM=False)
    if args.one_row:
        constexprs["M"] = 1
    # The word kernel launches with an explicit register limit (matmul.WORD_KERNEL_MAX_REGISTERS).
    maxnreg = WORD_KERNEL_MAX_REGISTERS if args.kernel == "int4-fma" else None
    compiled = compile_kernel(kernel, constexprs, args.warps, maxnreg=maxnreg)
    tiles = f", {args.row_tiles} row tiles, {args.x_tiles} x tiles" if args.kernel != "int4-fma" else ""
    shared = ", shared memory" if "local_alloc" in compiled.asm["ttgir"] else ""
    rows = ", one row" if args.one_row else ""
    print(f"{args.kernel} (sm_90, {args.warps} warps{tiles}{rows}{shared}): {report(compiled)}")


if __name__ == "__main__":
    main()
