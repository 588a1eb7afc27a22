#!/usr/bin/env bash
# One device call for the per-token fp8 quantization fused into RMSNorm and SiLU-and-mul:
# the GPU tests it touches, then W1 with fp8 weights + fp8 KV and with bf16 in this tree,
# and fp8 + fp8 KV in ab_base (the tree before; make it untracked first:
# mkdir ab_base && git archive <commit> kvserve | tar -x -C ab_base).
source "$(dirname "$0")/device_common.sh"
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider \
  tests/quantization/test_triton_kernels.py -k "fused or per_token" \
  > "$OUT/gpu_fused_tests_kernels.log" 2>&1
tail -2 "$OUT/gpu_fused_tests_kernels.log"
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/model_executor/test_triton_ops.py \
  "tests/gpu/test_quantized_engine_gpu.py::test_fp8_norms_and_activation_quantize_for_scaled_mm" tests/gpu/test_dependent_launch.py > "$OUT/gpu_fused_tests_engine.log" 2>&1
tail -2 "$OUT/gpu_fused_tests_engine.log"
bench_tree . w1-fp8-fp8kv $W1_ARGS --quantization fp8 --kv-cache-dtype fp8
bench_tree . w1-bf16 $W1_ARGS
bench_tree ab_base w1-fp8-fp8kv $W1_ARGS --quantization fp8 --kv-cache-dtype fp8
