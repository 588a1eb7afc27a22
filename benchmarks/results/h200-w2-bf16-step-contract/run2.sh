#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ROOT=$PWD
PYTHONPATH=$ROOT timeout ${TEST_TIMEOUT:-400} python -m pytest -v -m gpu ${TESTS:-tests/gpu} -p no:cacheprovider 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|passed|failed|error" > "$OUT/gpu_tests.log"
grep -c PASSED "$OUT/gpu_tests.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -12
w2() {
  (cd "$1" && PYTHONPATH=$PWD python -m kvserve.entrypoints.cli --log-level WARNING bench latency \
    --load-format dummy --model-shape llama3-8b --batch-sizes ${BATCHES:-1,64} --input-len 128 --output-len 256 \
    --output-json "$OUT/w2-$2.json" 2>&1 | tail -3)
}
if [ "${W2:-1}" = 1 ]; then
  echo "== W2 head"; w2 "$ROOT" head-2
  echo "== W2 base"; w2 ab/base base-2
fi
