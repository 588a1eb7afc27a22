#!/usr/bin/env bash
# fp8 rows quantized by the RMSNorm and SwiGLU kernels (Fp8Rows) at 2-128 decode rows: W2 at
# batch 4, 16 and 64 with fp8 in the parent tree (ab_base, `mkdir ab_base && git archive HEAD
# kvserve | tar -x -C ab_base`) and this one, then the GPU tests of the kernels and of the
# engine (pytest -v into $OUT/tests.txt, so a timeout keeps what finished). Results in $OUT.
source "$(dirname "$0")/device_common.sh"
ROUNDS=${ROUNDS:-1} BENCH_TIMEOUT=120 TAIL=5 ab_rounds w2-fp8 latency --batch-sizes 4,16,64 --input-len 128 \
  --quantization fp8
timeout "${TEST_TIMEOUT:-330}" python -m pytest -v -rf -m gpu -p no:cacheprovider tests/model_executor/test_triton_ops.py \
  tests/gpu/test_dependent_launch.py tests/quantization/test_fp8_w8a8.py tests/gpu/test_quantized_engine_gpu.py \
  > "$OUT/tests.txt" 2>&1
grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.txt" | tail -15
