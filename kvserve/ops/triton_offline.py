"""Compile a Triton kernel for a GPU without one (Triton's own ptxas, cuobjdump and nvdisasm,
shipped in its wheel): how CI checks the kernels only a GPU can run (inline PTX such as
mma.sync, which Triton's interpreter cannot execute), and what benchmarks/sass_report.py
reads registers and instructions from."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Mapping

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# The weight-only kernels' pointer arguments, by name, and the integers that are multiples
# of 16 on llama3-8b's shapes (Triton specializes on both at launch).
WEIGHT_ONLY_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "scale_ptr": "*fp32", "offset_ptr": "*fp32",
                        "partial_ptr": "*fp32", "out_ptr": "*bf16", "count_ptr": "*i32",
                        # The fused RMSNorm's operands (PendingNorm) and its eps.
                        "pending_ptr": "*fp32", "residual_ptr": "*bf16", "norm_weight_ptr": "*bf16",
                        "sum_squares_ptr": "*fp32", "norm_eps": "fp32"}
WEIGHT_ONLY_DIVISIBLE = ("stride_wn", "stride_ps", "stride_om", "N", "stride_xm", "stride_sn", "group_size")


def compile_kernel(kernel, constexprs: Mapping[str, object], num_warps: int = 4, num_stages: int = 1,
                   capability: int = 90, types: Mapping[str, str] = WEIGHT_ONLY_POINTERS,
                   divisible: tuple[str, ...] = WEIGHT_ONLY_DIVISIBLE, maxnreg: int | None = None):
    """`kernel` compiled for sm_`capability`: arguments named in `types` get those Triton
    types ("*bf16", "fp32", ...), the other non-constexpr ones int32, and pointers and
    `divisible` ones are taken to be multiples of 16; `maxnreg` as the launch passes it."""
    names = kernel.arg_names
    signature = {name: types.get(name, "i32") for name in names}
    signature.update({name: "constexpr" for name in constexprs})
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in names
             if signature[name].startswith("*") or name in divisible}
    source = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def cuda_tool(name: str, cubin: bytes, *flags: str) -> str:
    """The output of one of Triton's CUDA binaries (cuobjdump, nvdisasm) on a cubin."""
    binary = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([binary, *flags, file.name], capture_output=True, text=True, check=True).stdout


def resource_usage(compiled) -> tuple[int, int]:
    """(registers a thread, bytes of stack a thread) of a compiled kernel: stack above 0
    means registers spilled to local memory."""
    usage = re.search(r"REG:(\d+).*?STACK:(\d+)", cuda_tool("cuobjdump", compiled.asm["cubin"], "-res-usage"))
    return int(usage.group(1)), int(usage.group(2))


def main_loop(compiled) -> list[str]:
    """The SASS instructions (opcode and operands, predicates kept) of a compiled kernel's
    longest loop: the span from a branch target to the furthest backward branch to it."""
    addresses = {}  # label -> address of its first instruction
    instructions = []
    label = None
    for line in cuda_tool("nvdisasm", compiled.asm["cubin"], "-c").splitlines():
        if match := re.match(r"\s*(\.L_x_\d+):", line):
            label = match.group(1)
        elif match := re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            address = int(match.group(1), 16)
            instructions.append((address, match.group(2)))
            if label:
                addresses[label], label = address, None
    loops = [(addresses[m.group(1)], address) for address, text in instructions
             if (m := re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)) and addresses.get(m.group(1), address) < address]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return [text for address, text in instructions if start <= address <= end]
