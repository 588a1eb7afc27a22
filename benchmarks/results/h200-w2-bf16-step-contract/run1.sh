#!/usr/bin/env bash
# GPU checks of the step-contract change: engine GPU tests, then W2 / W1 beside the parent tree.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ROOT=$PWD
PYTHONPATH=$ROOT timeout 330 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider -x 2>&1 | grep -v "^\s*$" | tail -8
w2() {  # tree dir, label
  (cd "$1" && PYTHONPATH=$PWD python -m kvserve.entrypoints.cli --log-level WARNING bench latency \
    --load-format dummy --model-shape llama3-8b --batch-sizes 1,16,64 --input-len 128 --output-len 256 \
    --output-json "$OUT/w2-$2.json" 2>&1 | tail -5)
}
w1() {
  (cd "$1" && PYTHONPATH=$PWD python -m kvserve.entrypoints.cli --log-level WARNING bench throughput \
    --load-format dummy --model-shape qwen2.5-0.5b --num-prompts 256 --input-len 100 1024 --output-len 100 1024 \
    --no-sequential --no-transformers --output-json "$OUT/w1-$2.json" 2>&1 | grep -v Generating | tail -3)
}
for round in ${ROUNDS:-1}; do
  echo "== W2 base $round"; w2 ab/base base-$round
  echo "== W2 head $round"; w2 "$ROOT" head-$round
done
[ "${W1:-0}" = 1 ] && { echo "== W1 base"; w1 ab/base base; }
[ "${W1:-0}" = 1 ] && { echo "== W1 head"; w1 "$ROOT" head; }
