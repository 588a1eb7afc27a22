"""The decode chain's programmatic dependent launch (kvserve.ops.pdl), compiled for
sm_90 on the CPU machine (kvserve.ops.triton_offline): CI runs these kernels with PDL off (no
GPU, or the interpreter), so this is where it checks what the GPU runs. Every chained kernel
lets the next kernel launch and then waits for the one before it ahead of its first global
load: a load above the wait could read the previous kernel's output before it is written."""

from __future__ import annotations

import re

import pytest

from kvserve.ops import elementwise, fused_moe_gemv
from kvserve.ops.attention import kv_cache_write, paged_attention
from kvserve.ops.triton_offline import compile_kernel

BF16 = "*bf16"
# A fused RMSNorm's operands in a producer's epilogue (PendingNorm).
NORM_OPERANDS = {"residual_ptr": BF16, "norm_weight_ptr": BF16, "sum_squares_ptr": "*fp32"}
# (name, kernel, argument types, constexprs) for llama3-8b's decode shapes and
# Qwen3-30B-A3B's experts.
CHAINED_KERNELS = [
    ("add_rms_norm", elementwise._add_rms_norm_kernel,
     {"x_ptr": BF16, "residual_ptr": BF16, "weight_ptr": BF16, "out_ptr": BF16, "scale_ptr": BF16, "eps": "fp32"},
     dict(HAS_RESIDUAL=True, BLOCK=4096, FP8=False)),
    ("add_rms_norm_fp8", elementwise._add_rms_norm_kernel,
     {"x_ptr": BF16, "residual_ptr": BF16, "weight_ptr": BF16, "out_ptr": "*u8", "scale_ptr": "*fp32",
      "eps": "fp32"}, dict(HAS_RESIDUAL=True, BLOCK=4096, FP8=True)),
    ("rotary", elementwise._rotary_kernel, {"x_ptr": BF16, "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
     dict(HALF=64, HALF_PAD=64, HEADS_PAD=64)),
    ("silu_and_mul", elementwise._silu_and_mul_kernel, {"x_ptr": BF16, "out_ptr": BF16, "scale_ptr": BF16},
     dict(BLOCK=1024, FP8=False)),
    ("silu_and_mul_fp8", elementwise._silu_and_mul_kernel, {"x_ptr": BF16, "out_ptr": "*u8", "scale_ptr": "*fp32"},
     dict(BLOCK=16384, FP8=True)),
    ("write_kv_float8", kv_cache_write._write_kv_kernel,
     {"key_ptr": BF16, "value_ptr": BF16, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv",
      "slot_mapping_ptr": "*i64", "inv_k_scale": "fp32", "inv_v_scale": "fp32"},
     dict(FP8_MAX=448.0, KV_HEADS_PAD=8, HEAD_DIM=128)),
    ("paged_attention", paged_attention._paged_attention_kernel,
     {"out_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "q_ptr": BF16, "k_cache_ptr": BF16,
      "v_cache_ptr": BF16, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
      "qk_scale": "fp32", "v_scale": "fp32"},
     # The wide-batch form; the narrow decode tile reads its metadata first (test_attention_compile).
     dict(BLOCK_SIZE=16, SPLIT=True, GROUP=4, GROUP_PAD=4, HEAD_DIM=128, BLOCK_M=16, BLOCK_N=128,
          DOT_PRECISION="tf32", FP16_DOTS=False, V_FLOAT8_ASM="", EARLY_METADATA=False, NEW_KV=False,
          NEW_KEYS=0, TREE=False)),
    ("merge_splits", paged_attention._merge_splits_kernel,
     {"out_ptr": BF16, "partial_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32"}, dict(HEAD_DIM=128)),
    ("expert_gate_up_gemv", fused_moe_gemv._pair_gemv_kernel,
     {"x_ptr": BF16, "w_ptr": BF16, "scale_ptr": BF16, "offset_ptr": BF16, "out_ptr": BF16, "chosen_ptr": "*i32",
      "pending_ptr": "*fp32", "norm_eps": "fp32"},
     dict(ROWS_PER_X=8, SWIGLU=True, QUANT=False, FOUR_BIT=False, HAS_OFFSET=False, GROUP_SIZE=2048,
          BLOCK_N=8, BLOCK_K=256, ROW_SCALE=False, PARTIALS=1)),
    # Finishing the RMSNorm that o_proj left pending (PendingNorm): its sums read after the wait.
    ("expert_gate_up_gemv_pending_norm", fused_moe_gemv._pair_gemv_kernel,
     {"x_ptr": BF16, "w_ptr": BF16, "scale_ptr": BF16, "offset_ptr": BF16, "out_ptr": BF16, "chosen_ptr": "*i32",
      "pending_ptr": "*fp32", "norm_eps": "fp32"},
     dict(ROWS_PER_X=8, SWIGLU=True, QUANT=False, FOUR_BIT=False, HAS_OFFSET=False, GROUP_SIZE=2048,
          BLOCK_N=8, BLOCK_K=256, ROW_SCALE=True, PARTIALS=512)),
    ("expert_down_gemv_int4", fused_moe_gemv._pair_gemv_kernel,
     {"x_ptr": BF16, "w_ptr": "*u8", "scale_ptr": BF16, "offset_ptr": BF16, "out_ptr": "*fp32",
      "chosen_ptr": "*i32", "pending_ptr": "*fp32", "norm_eps": "fp32"},
     dict(ROWS_PER_X=1, SWIGLU=False, QUANT=True, FOUR_BIT=True, HAS_OFFSET=True, GROUP_SIZE=128,
          BLOCK_N=8, BLOCK_K=512, ROW_SCALE=False, PARTIALS=1)),
    *((f"expert_summed_down_gemv{'_add_norm' * add_norm}", fused_moe_gemv._summed_gemv_kernel,
       {"x_ptr": BF16, "w_ptr": BF16, "scale_ptr": BF16, "offset_ptr": BF16, "out_ptr": BF16, "chosen_ptr": "*i32",
        "weights_ptr": "*fp32", **NORM_OPERANDS},
       dict(TOP_K=2, QUANT=False, FOUR_BIT=False, HAS_OFFSET=False, GROUP_SIZE=14336, BLOCK_N=8, BLOCK_K=512,
            ADD_NORM=add_norm)) for add_norm in (False, True)),
    # With add_norm the residual add and the next RMSNorm left pending (PendingNorm) in the
    # epilogue: the residual stream is the earlier kernels' output too.
    *((f"expert_combine{'_add_norm' * add_norm}", fused_moe_gemv._combine_kernel,
       {"partials_ptr": "*fp32", "weights_ptr": "*fp32", "out_ptr": BF16, **NORM_OPERANDS},
       dict(TOP_K=8, BLOCK=512, ADD_NORM=add_norm)) for add_norm in (False, True)),
]


@pytest.mark.parametrize(("name", "kernel", "types", "constexprs"), CHAINED_KERNELS,
                         ids=[case[0] for case in CHAINED_KERNELS])
def test_chained_kernels_wait_before_their_first_load(name, kernel, types, constexprs) -> None:
    ptx = compile_kernel(kernel, {**constexprs, "PDL": True}, types=types, divisible=()).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    launch = body.index("griddepcontrol.launch_dependents")
    wait = body.index("griddepcontrol.wait")
    first_load = re.search(r"\bld\.global|\bcp\.async", body)
    assert first_load is not None, f"{name}: no global load found"
    assert launch < wait < first_load.start(), f"{name}: a global load comes before the wait"
