#!/usr/bin/env bash
# GPU checks of the engine core split: the GPU engine tests, then W2 (bf16 llama3-8b, dummy
# weights) on the parent tree (kvserve/ of the parent unpacked into ab/base), this tree, and
# this tree with the engine core in its own process, interleaved. As run:
#   TESTS=1 VARIANTS="mp" bash run.sh        (call 1)
#   TESTS=0 VARIANTS="base head base head" bash run.sh   (call 2)
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ROOT=$PWD
if [ "${TESTS:-1}" = 1 ]; then
  PYTHONPATH=$ROOT timeout "${TEST_TIMEOUT:-330}" python -m pytest -v -m gpu tests/gpu -p no:cacheprovider 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|passed|failed|error|^E " > "$OUT/gpu_tests.log"
  grep -c PASSED "$OUT/gpu_tests.log"; grep -E "FAILED|ERROR|passed|failed|^E " "$OUT/gpu_tests.log" | tail -20
fi
w2() {  # tree, label, extra flags
  (cd "$1" && PYTHONPATH=$PWD python -m kvserve.entrypoints.cli --log-level WARNING bench latency \
    --load-format dummy --model-shape llama3-8b --batch-sizes "${BATCHES:-1,16,64}" --input-len 128 \
    --output-len 256 --output-json "$OUT/w2-$2.json" $3 2>&1 | tail -4)
}
n=0
for variant in ${VARIANTS:-base head mp}; do
  n=$((n + 1))
  echo "== W2 $variant"
  case $variant in
    base) w2 ab/base "base-$n" "" ;;
    head) w2 "$ROOT" "head-$n" "" ;;
    mp) w2 "$ROOT" "mp-$n" "--multiprocess-engine-core" ;;
  esac
done
