"""The GPU-only weight-only kernels, compiled for sm_90 on the CPU machine (Triton's own
ptxas; kvserve.triton_offline): the mma.sync kernels use inline PTX that Triton's
interpreter cannot run, so this is what CI can check of them. Their numerics are checked on
a GPU (test_triton_kernels.py's gpu tests). The decode configurations must keep to
registers: a spill to local memory would cost every decode step."""

from __future__ import annotations

import pytest

from kvserve.quantization.weight_only import mma, words
from kvserve.triton_offline import compile_kernel, cuda_tool, resource_usage

# (name, kernel, constexprs): the one-row and few-row decode kernels as the configs launch them.
DECODE_KERNELS = [
    ("int4-mma-1-tile", mma.int4_mma_kernel,
     dict(FP16=False, HAS_OFFSET=True, SPLIT=True, ROW_TILES=2, NUM_WARPS=4, X_TILES=1, LAUNCH_NEXT=True)),
    ("int4-mma-2-tiles-fp16-no-offset", mma.int4_mma_kernel,
     dict(FP16=True, HAS_OFFSET=False, SPLIT=True, ROW_TILES=2, NUM_WARPS=4, X_TILES=2, LAUNCH_NEXT=True)),
    ("fp8-mma-1-tile", mma.fp8_mma_kernel,
     dict(X_BF16=True, SPLIT=True, ROW_TILES=2, NUM_WARPS=4, X_TILES=1, LAUNCH_NEXT=True)),
    ("fp8-mma-2-tiles", mma.fp8_mma_kernel,
     dict(X_BF16=True, SPLIT=True, ROW_TILES=2, NUM_WARPS=4, X_TILES=2, LAUNCH_NEXT=True)),
    ("int4-fma-one-row", words.int4_gemv_kernel,
     dict(X_BF16=True, HAS_OFFSET=True, SPLIT=True, BLOCK_M=1, BLOCK_N=128, BLOCK_K=256, TWO_GROUPS=True,
          PDL=True)),
]


@pytest.mark.parametrize(("name", "kernel", "constexprs"), DECODE_KERNELS, ids=[case[0] for case in DECODE_KERNELS])
def test_decode_kernels_compile_for_sm90_without_spilling(name, kernel, constexprs) -> None:
    compiled = compile_kernel(kernel, constexprs)
    registers, stack = resource_usage(compiled)
    assert stack == 0, f"{name}: {registers} registers and {stack} bytes of stack (spilled)"
    sass = cuda_tool("nvdisasm", compiled.asm["cubin"], "-c")
    if "mma" in name:  # the inline mma.sync became tensor-core instructions
        assert "HMMA.16816.F32" in sass
    # Each lets the next kernel of the decode chain launch early (dependent_launch).
    assert "griddepcontrol.launch_dependents" in compiled.asm["ptx"]
