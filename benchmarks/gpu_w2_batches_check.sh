#!/usr/bin/env bash
# The quantized engine GPU tests, then W2's batch-16 and batch-64 variants (WORKLOADS.md) with
# fp8 weights and with bf16, on llama3-8b dummy weights. Results in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout "${TEST_TIMEOUT:-240}" python -m pytest -v -m gpu -p no:cacheprovider tests/gpu/test_quantized_engine_gpu.py 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|passed|failed" | tee "$OUT/tests.txt"
for q in fp8 none; do
  flags=(); [ "$q" = none ] || flags=(--quantization "$q")
  BENCH_TIMEOUT=60 TAIL=4 bench_tree . w2-b16-b64-$q latency --batch-sizes 16,64 --input-len 128 "${flags[@]}"
done
