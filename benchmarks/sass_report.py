"""Registers and the main loop's instruction mix of kvserve's one-row/few-row GEMV kernels,
compiled for sm_90 on any machine (Triton's own ptxas, cuobjdump and nvdisasm; no GPU): the
instruction counts BENCHMARKS.md quotes.

    python benchmarks/sass_report.py [int4-fma|int4-mma|fp8-mma] [--warps 4] [--row-tiles 2] [--x-tiles 1]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvserve.quantization.weight_only import mma, words

_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "scale_ptr": "*fp32", "offset_ptr": "*fp32",
             "partial_ptr": "*fp32", "out_ptr": "*bf16", "count_ptr": "*i32"}
# Launch-time integers Triton sees as multiples of 16 on llama3-8b's shapes.
_DIVISIBLE = ("stride_wn", "stride_ps", "stride_om", "N", "stride_xm", "stride_sn", "group_size")


def _compile(kernel, constexprs: dict, num_warps: int):
    names = kernel.arg_names
    signature = {name: _POINTERS.get(name, "i32") for name in names}
    signature.update({name: "constexpr" for name in constexprs})
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in names
             if signature[name].startswith("*") or name in _DIVISIBLE}
    source = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1})


def _tool(name: str, cubin: bytes, *flags: str) -> str:
    binary = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([binary, *flags, file.name], capture_output=True, text=True, check=True).stdout


def report(compiled) -> str:
    cubin = compiled.asm["cubin"]
    usage = re.search(r"REG:(\d+).*?STACK:(\d+)", _tool("cuobjdump", cubin, "-res-usage"))
    sass = _tool("nvdisasm", cubin, "-c")
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
    return (f"{usage.group(1)} registers, {usage.group(2)} bytes of stack; main loop "
            f"{sum(opcodes.values())} instructions: {mix}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", nargs="?", default="int4-mma", choices=("int4-fma", "int4-mma", "fp8-mma"))
    parser.add_argument("--warps", type=int, default=4, help="num_warps.")
    parser.add_argument("--row-tiles", type=int, default=2, help="mma kernels: 16-row tiles a warp.")
    parser.add_argument("--x-tiles", type=int, default=1, help="mma kernels: 8-row tiles of x (1, 2, 4, 8).")
    args = parser.parse_args()
    if args.kernel == "int4-fma":  # the production one-row config, 1x128x256
        compiled = _compile(words.int4_gemv_kernel, dict(X_BF16=True, HAS_OFFSET=True, SPLIT=True, BLOCK_M=1,
                                                       BLOCK_N=128, BLOCK_K=256, TWO_GROUPS=True, PDL=True),
                            args.warps)
    elif args.kernel == "int4-mma":
        compiled = _compile(mma.int4_mma_kernel, dict(FP16=False, HAS_OFFSET=True, SPLIT=True,
                                                      ROW_TILES=args.row_tiles, NUM_WARPS=args.warps, X_TILES=args.x_tiles),
                            args.warps)
    else:
        compiled = _compile(mma.fp8_mma_kernel, dict(X_BF16=True, SPLIT=True, ROW_TILES=args.row_tiles,
                                                     NUM_WARPS=args.warps, X_TILES=args.x_tiles), args.warps)
    tiles = f", {args.row_tiles} row tiles, {args.x_tiles} x tiles" if args.kernel != "int4-fma" else ""
    shared = ", shared memory" if "local_alloc" in compiled.asm["ttgir"] else ""
    print(f"{args.kernel} (sm_90, {args.warps} warps{tiles}{shared}): {report(compiled)}")


if __name__ == "__main__":
    main()
