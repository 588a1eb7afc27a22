"""The GPU-only weight-only kernels, compiled for sm_90 on the CPU machine (Triton's own
ptxas; kvserve.ops.triton_offline): the mma.sync kernels use inline PTX that Triton's
interpreter cannot run, so this is what CI can check of them. Their numerics are checked on
a GPU (test_weight_only.py's gpu tests). The decode configurations must keep their main
loop in registers: local memory there would cost every tile of every decode step (a few
values spilled around the loop, as the int4 kernel at one row does, cost nothing per tile)."""

from __future__ import annotations

import re
import statistics

import pytest

from kvserve.ops.quant.weight_only import mma, words
from kvserve.ops.quant.weight_only.matmul import WORD_KERNEL_MAX_REGISTERS
from kvserve.ops.triton_offline import WEIGHT_ONLY_POINTERS, compile_kernel, main_loop, resource_usage

# (name, kernel, constexprs): the decode kernels as the configs launch them; "M": 1 is how
# Triton specializes a launch of one row of x.
NO_NORM = dict(ROW_SCALE=False, PARTIALS=1)
FP8_MMA_ONE_ROW = dict(X_BF16=True, SPLIT=True, EVEN_SPLITS=True, ROW_TILES=2, NUM_WARPS=4, X_TILES=1, PDL=True, M=1)
INT4_MMA_ONE_ROW = dict(FP16=False, HAS_OFFSET=True, SPLIT=True, EVEN_SPLITS=False, ROW_TILES=2, NUM_WARPS=4,
                        X_TILES=1, LAUNCH_NEXT=True, M=1)
INT4_FMA_ONE_ROW = dict(X_BF16=True, HAS_OFFSET=True, SPLIT=True, EVEN_SPLITS=False, BLOCK_M=1, BLOCK_N=128,
                        BLOCK_K=256, TWO_GROUPS=True, PDL=True, M=1)
DECODE_KERNELS = [
    ("int4-mma-one-row", mma.int4_mma_kernel, INT4_MMA_ONE_ROW | NO_NORM),
    ("int4-mma-8-rows", mma.int4_mma_kernel,
     dict(FP16=False, HAS_OFFSET=True, SPLIT=True, EVEN_SPLITS=False, ROW_TILES=2, NUM_WARPS=4, X_TILES=1,
          LAUNCH_NEXT=True) | NO_NORM),
    # 9-16 rows (two x tiles): the narrow linears' config (64 weight rows on 4 warps) and the
    # wide gate/up's (configs.INT4_WIDE_TWO_TILES_CONFIG, 128 rows on 2 warps).
    ("int4-mma-16-rows", mma.int4_mma_kernel,
     dict(FP16=True, HAS_OFFSET=True, SPLIT=True, EVEN_SPLITS=False, ROW_TILES=1, NUM_WARPS=4, X_TILES=2,
          LAUNCH_NEXT=True) | NO_NORM),
    ("int4-mma-16-rows-wide", mma.int4_mma_kernel,
     dict(FP16=True, HAS_OFFSET=True, SPLIT=True, EVEN_SPLITS=False, ROW_TILES=4, NUM_WARPS=2, X_TILES=2,
          LAUNCH_NEXT=True) | NO_NORM),
    ("int4-mma-16-rows-fp16-no-offset", mma.int4_mma_kernel,
     dict(FP16=True, HAS_OFFSET=False, SPLIT=True, EVEN_SPLITS=False, ROW_TILES=2, NUM_WARPS=4, X_TILES=2,
          LAUNCH_NEXT=True) | NO_NORM),
    ("fp8-mma-one-row", mma.fp8_mma_kernel, FP8_MMA_ONE_ROW | NO_NORM | dict(ADD_NORM=False)),
    ("fp8-mma-16-rows", mma.fp8_mma_kernel,
     dict(X_BF16=True, SPLIT=True, EVEN_SPLITS=False, ROW_TILES=2, NUM_WARPS=4, X_TILES=2, PDL=True,
          ADD_NORM=False) | NO_NORM),
    ("int4-fma-one-row", words.int4_gemv_kernel, INT4_FMA_ONE_ROW | NO_NORM | dict(ADD_NORM=False)),
    # The fused RMSNorm (PendingNorm) as llama3-8b's one-row step runs it: gate/up and qkv
    # finish a norm (32 partial sums), o_proj and down leave one.
    ("int4-mma-one-row-pending-norm", mma.int4_mma_kernel, INT4_MMA_ONE_ROW | dict(ROW_SCALE=True, PARTIALS=32)),
    ("int4-fma-one-row-pending-norm", words.int4_gemv_kernel,
     INT4_FMA_ONE_ROW | dict(ROW_SCALE=True, PARTIALS=32, ADD_NORM=False)),
    ("int4-fma-one-row-add-norm", words.int4_gemv_kernel, INT4_FMA_ONE_ROW | NO_NORM | dict(ADD_NORM=True)),
    # fp8 at one row: qkv finishes a norm on mma.sync, o_proj and down leave one.
    ("fp8-mma-one-row-pending-norm", mma.fp8_mma_kernel,
     FP8_MMA_ONE_ROW | dict(ROW_SCALE=True, PARTIALS=32, ADD_NORM=False)),
    ("fp8-mma-one-row-add-norm", mma.fp8_mma_kernel, FP8_MMA_ONE_ROW | NO_NORM | dict(ADD_NORM=True)),
]


def _compiled(name: str, kernel, constexprs: dict):
    """The kernel as the launches compile it: int4 layers keep fp16 scales and offsets on CUDA
    (Int4Linear.compact_scales); the 4-bit word kernel takes a register limit."""
    scales = {"scale_ptr": "*fp16", "offset_ptr": "*fp16"} if name.startswith("int4") else {}
    maxnreg = WORD_KERNEL_MAX_REGISTERS if kernel is words.int4_gemv_kernel else None
    return compile_kernel(kernel, constexprs, types=WEIGHT_ONLY_POINTERS | scales, maxnreg=maxnreg)


@pytest.mark.parametrize("plain", ["int4-fma-one-row", "fp8-mma-one-row"])
def test_fused_norm_variants_keep_the_kernels_registers(plain) -> None:
    """ptxas schedules the one-row word kernel's next weight tile mid-loop with ~255
    registers; its fused-norm variants, left to themselves, get 168 and load at the loop's
    end (slower by 1-4 us a call on an H100). The launch's register limit
    keeps them with the plain kernel; the fp8 mma.sync kernel's variants compile alike."""
    usage = {name: resource_usage(_compiled(name, kernel, constexprs))[0]
             for name, kernel, constexprs in DECODE_KERNELS if name.startswith(plain)}
    registers = usage.pop(plain)
    assert usage and all(count >= registers - 8 for count in usage.values()), (registers, usage)


@pytest.mark.parametrize(("name", "kernel", "constexprs"), DECODE_KERNELS, ids=[case[0] for case in DECODE_KERNELS])
def test_decode_kernels_compile_for_sm90_without_spilling_in_their_loop(name, kernel, constexprs) -> None:
    # int4 layers keep fp16 scales and offsets on CUDA (Int4Linear.compact_scales).
    compiled = _compiled(name, kernel, constexprs)
    loop = main_loop(compiled)
    spills = [text for text in loop if re.search(r"\b(LDL|STL)\b", text)]
    registers, stack = resource_usage(compiled)
    assert not spills, f"{name}: {registers} registers; local memory in the loop: {spills}"
    if "mma" in name:  # the inline mma.sync became tensor-core instructions
        assert any("HMMA.16816.F32" in text for text in loop)
    # Each lets the next kernel of the decode chain launch early; those launched as
    # programmatic dependents (PDL) wait for the kernel before them after their first weight
    # loads and before any product (kvserve.ops.pdl), the int4 mma kernel not at all.
    ptx = compiled.asm["ptx"]
    trigger, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
    first_product = min(ptx.find(op) for op in ("mma.sync", "fma.rn") if op in ptx)
    if constexprs.get("PDL"):
        assert 0 <= trigger < wait < first_product, (trigger, wait, first_product)
    else:
        assert trigger >= 0 and wait < 0


@pytest.mark.parametrize("name", ["int4-fma-one-row-pending-norm", "int4-fma-one-row-add-norm"])
def test_one_row_word_kernel_loads_its_next_tile_mid_loop(name) -> None:
    """At 254-255 registers ptxas pipelines the one-row int4 word kernel's weight loads one
    of two ways, and which one follows from the epilogue's code, not the loop's: most of the
    next tile's loads in the loop's second half (median position 0.66-0.69 of the loop, the
    kernel every W2 measurement ran), or clustered at its start (0.08-0.10). Both epilogues
    tried that got the second form ran W2 int4 slower than their changes predict (split-K
    without its tail 2.46-2.47 ms of GPU step against 2.41-2.43 with it, a fence-free tail no
    faster than the fenced one), so an epilogue change that flips it needs a measurement of
    its own. These are the variants a W2 step runs (qkv
    finishes a norm, o_proj and down leave one). The plain variant (no norm) flipped when
    the group scales began to move as int64 pairs and measured faster anyway: llama3-8b's
    q_proj alone 6.70 -> 6.37 us on an H100."""
    constexprs = next(constexprs for case, _, constexprs in DECODE_KERNELS if case == name)
    loop = main_loop(_compiled(name, words.int4_gemv_kernel, constexprs))
    loads = [i / len(loop) for i, text in enumerate(loop) if re.match(r"(@!?P\d+\s+)?LDG", text)]
    assert len(loads) >= 16 and statistics.median(loads) > 0.5, (len(loads), statistics.median(loads))
