#!/usr/bin/env bash
# One device call: W1 (offline-mixed, WORKLOADS.md) on llama3-8b dummy weights with bf16
# weights and cache, fp8 weights + fp8 KV cache, and bf16 weights + fp8 KV cache, back to
# back on the same machine. Results land in $OUT.
source "$(dirname "$0")/device_common.sh"
run() {  # name, extra flags
  local name=$1
  shift
  echo "== W1 llama3-8b $name"
  timeout "${W1_TIMEOUT:-170}" python -m kvserve.entrypoints.cli --log-level WARNING bench throughput \
    --load-format dummy --model-shape llama3-8b --num-prompts 256 --input-len 100 1024 \
    --output-len 100 1024 --no-sequential --no-transformers "$@" \
    --output-json "$OUT/w1-llama3-8b-$name.json" 2>&1 | grep -v "Generating" | tail -3
}
run bf16
run fp8-fp8kv --quantization fp8 --kv-cache-dtype fp8
run bf16-fp8kv --kv-cache-dtype fp8
