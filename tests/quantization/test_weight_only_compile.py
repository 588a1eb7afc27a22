"""The GPU-only weight-only kernels, compiled for sm_90 on the CPU machine (Triton's own
ptxas; kvserve.triton_offline): the mma.sync kernels use inline PTX that Triton's
interpreter cannot run, so this is what CI can check of them. Their numerics are checked on
a GPU (test_triton_kernels.py's gpu tests). The decode configurations must keep their main
loop in registers: local memory there would cost every tile of every decode step (a few
values spilled around the loop, as the int4 kernel at one row does, cost nothing per tile)."""

from __future__ import annotations

import re

import pytest

from kvserve.quantization.weight_only import mma, words
from kvserve.triton_offline import WEIGHT_ONLY_POINTERS, compile_kernel, main_loop, resource_usage

# (name, kernel, constexprs): the decode kernels as the configs launch them; "M": 1 is how
# Triton specializes a launch of one row of x.
DECODE_KERNELS = [
    ("int4-mma-one-row", mma.int4_mma_kernel,
     dict(FP16=False, HAS_OFFSET=True, SPLIT=True, ROW_TILES=2, NUM_WARPS=4, X_TILES=1, LAUNCH_NEXT=True, M=1)),
    ("int4-mma-8-rows", mma.int4_mma_kernel,
     dict(FP16=False, HAS_OFFSET=True, SPLIT=True, ROW_TILES=2, NUM_WARPS=4, X_TILES=1, LAUNCH_NEXT=True)),
    ("int4-mma-16-rows-fp16-no-offset", mma.int4_mma_kernel,
     dict(FP16=True, HAS_OFFSET=False, SPLIT=True, ROW_TILES=2, NUM_WARPS=4, X_TILES=2, LAUNCH_NEXT=True)),
    ("fp8-mma-one-row", mma.fp8_mma_kernel,
     dict(X_BF16=True, SPLIT=True, ROW_TILES=2, NUM_WARPS=4, X_TILES=1, PDL=True, M=1)),
    ("fp8-mma-16-rows", mma.fp8_mma_kernel,
     dict(X_BF16=True, SPLIT=True, ROW_TILES=2, NUM_WARPS=4, X_TILES=2, PDL=True)),
    ("int4-fma-one-row", words.int4_gemv_kernel,
     dict(X_BF16=True, HAS_OFFSET=True, SPLIT=True, BLOCK_M=1, BLOCK_N=128, BLOCK_K=256, TWO_GROUPS=True,
          PDL=True, M=1)),
]


@pytest.mark.parametrize(("name", "kernel", "constexprs"), DECODE_KERNELS, ids=[case[0] for case in DECODE_KERNELS])
def test_decode_kernels_compile_for_sm90_without_spilling_in_their_loop(name, kernel, constexprs) -> None:
    # int4 layers keep fp16 scales and offsets on CUDA (Int4Linear.compact_scales).
    scales = {"scale_ptr": "*fp16", "offset_ptr": "*fp16"} if name.startswith("int4") else {}
    compiled = compile_kernel(kernel, constexprs, types=WEIGHT_ONLY_POINTERS | scales)
    loop = main_loop(compiled)
    spills = [text for text in loop if re.search(r"\b(LDL|STL)\b", text)]
    registers, stack = resource_usage(compiled)
    assert not spills, f"{name}: {registers} registers; local memory in the loop: {spills}"
    if "mma" in name:  # the inline mma.sync became tensor-core instructions
        assert any("HMMA.16816.F32" in text for text in loop)
    # Each lets the next kernel of the decode chain launch early; those launched as
    # programmatic dependents (PDL) wait for the kernel before them after their first weight
    # loads and before any product (dependent_launch), the int4 mma kernel not at all.
    ptx = compiled.asm["ptx"]
    trigger, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
    first_product = min(ptx.find(op) for op in ("mma.sync", "fma.rn") if op in ptx)
    if constexprs.get("PDL"):
        assert 0 <= trigger < wait < first_product, (trigger, wait, first_product)
    else:
        assert trigger >= 0 and wait < 0
