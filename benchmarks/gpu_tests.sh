#!/usr/bin/env bash
# The GPU tests (`pytest -m gpu`) in parts that each fit a 10-minute device call (on a fresh
# machine Triton compiles every kernel variant first, so the whole set takes longer). Run
# them in one process: the engine tests size their KV cache from the free GPU memory, so
# parallel workers run each other out of it.
#
#   bash benchmarks/gpu_tests.sh PART
#
# Parts:
#   1   quantization kernels, all but the layer tests
#   2   the layer tests (every kind, bf16 and fp16)
#   3   engine, PDL, speculative decoding (tests/gpu)
#   4   attention kernels, elementwise ops, argmax
#
# pytest runs with -v, so a part cut off by the time limit still reports what ran. The log
# goes to $OUT/gpu_tests_PART.log (default OUT /tmp/kvserve-gpu); TEST_TIMEOUT (default 540)
# bounds the run in seconds.
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ] || [ $# -eq 0 ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  [ $# -gt 0 ]; exit $?
fi
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvserve-gpu}
mkdir -p "$OUT"
PART=$1
case $PART in
  1) TESTS=(tests/ops/quant/test_weight_only.py tests/quantization/test_int4_lm_head.py -k "not layers_match") ;;
  2) TESTS=(tests/ops/quant/test_weight_only.py -k "layers_match") ;;
  3) TESTS=(tests/gpu) ;;
  4) TESTS=(tests/attention/test_triton_attention.py tests/ops/test_elementwise.py tests/ops/test_argmax.py) ;;
  *) echo "part must be 1, 2, 3 or 4 (see --help)" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${TEST_TIMEOUT:-540}" python -m pytest -v -m gpu -p no:cacheprovider --durations=5 "${TESTS[@]}" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error|s call " | tee "$OUT/gpu_tests_$PART.log" | tail -40
