#!/usr/bin/env bash
# The GPU tests gpu_fp8_rows_check.sh did not reach (Fp8Rows against the unfused quantization
# in the engine, the one-row fused norms), the fused kernels at fp16 and bf16, then W1 with
# fp8 + fp8 KV and bf16 (the ratio #6 targets). Results in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout "${TEST_TIMEOUT:-260}" python -m pytest -v -rf -m gpu -p no:cacheprovider tests/model_executor/test_triton_ops.py \
  tests/gpu/test_quantized_engine_gpu.py::test_fp8_rows_from_the_norm_and_swiglu_kernels_change_no_bit \
  tests/gpu/test_quantized_engine_gpu.py::test_fused_norms_decode_like_the_unfused_chain > "$OUT/tests.txt" 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " "$OUT/tests.txt" | tail -15
BENCH_TIMEOUT=140 bench_tree . w1-fp8-fp8kv $W1_ARGS --quantization fp8 --kv-cache-dtype fp8
BENCH_TIMEOUT=140 bench_tree . w1-bf16 $W1_ARGS
