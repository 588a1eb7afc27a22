#!/usr/bin/env bash
# One device call for the start-up warm-up of the attention kernels: the GPU attention and
# engine tests (log in $OUT), then the JIT census (benchmarks/gpu_jit_census.py: which Triton
# kernels compile after the engine started, and W1 on a cold Triton cache, run twice) for
# bf16, int4, and fp8 weights + fp8 KV.
source "$(dirname "$0")/device_common.sh"
timeout 300 python -m pytest -q -m gpu ${TESTS:-tests/attention tests/gpu/test_engine_gpu.py} -p no:cacheprovider \
  > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log"; grep -E "^FAILED" "$OUT/gpu_tests.log" | head
for quant in "" "--quantization int4" "--quantization fp8 --kv-cache-dtype fp8"; do
  echo "#### census $quant"
  timeout 120 python benchmarks/gpu_jit_census.py $quant 2>&1 | grep -v "Generating\|it/s\]" | tail -25
done
