#!/usr/bin/env bash
# The GPU tests (`-m gpu`) in parts that fit one device call each (a cold Triton cache
# compiles every kernel variant, so the whole set takes longer than one call may run):
#   bash benchmarks/gpu_tests.sh 1   quantization kernels, all but the layer tests
#   bash benchmarks/gpu_tests.sh 2   the layer tests (every kind, bf16 and fp16)
#   bash benchmarks/gpu_tests.sh 3   engine, PDL, speculative decoding (tests/gpu)
#   bash benchmarks/gpu_tests.sh 4   attention kernels, elementwise ops, argmax
# -v prints each result as it lands, so a part cut off by the call's limit still reports
# what ran. Log in $OUT/gpu_tests_PART.log.
source "$(dirname "$0")/device_common.sh"
PART=${1:?part 1, 2, 3 or 4}
case $PART in
  1) TESTS=(tests/quantization/test_triton_kernels.py tests/quantization/test_int4_lm_head.py -k "not layers_match") ;;
  2) TESTS=(tests/quantization/test_triton_kernels.py -k "layers_match") ;;
  3) TESTS=(tests/gpu) ;;
  4) TESTS=(tests/attention/test_triton_attention.py tests/model_executor/test_triton_ops.py tests/sample/test_argmax.py) ;;
  *) echo "part 1, 2, 3 or 4" >&2; exit 2 ;;
esac
timeout "${TEST_TIMEOUT:-540}" python -m pytest -v -m gpu -p no:cacheprovider --durations=5 "${TESTS[@]}" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error|s call " | tee "$OUT/gpu_tests_$PART.log" | tail -40
