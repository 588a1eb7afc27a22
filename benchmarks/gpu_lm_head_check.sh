#!/usr/bin/env bash
# One device call: the int4 LM head's GPU test, W2 batch 1 on llama3-8b dummy weights with
# int4 linears and the bf16 head, then with the int4 head (quantization_config lm_head), then
# the int4 GPU kernel tests (the one-row kernel's weight loads are evict_first).
source "$(dirname "$0")/device_common.sh"
timeout 120 python -m pytest -q -m gpu tests/quantization/test_int4_lm_head.py -p no:cacheprovider 2>&1 | tail -3
for head in false true; do
  echo "== W2 llama3-8b quantization=int4 lm_head=$head"
  timeout 120 python -m kvserve.entrypoints.cli --log-level WARNING bench latency --load-format dummy \
    --model-shape llama3-8b --batch-sizes 1 --input-len 128 --output-len 128 --quantization int4 \
    --quantization-config "{\"lm_head\": $head}" --output-json "$OUT/w2-int4-head-$head.json" 2>&1 | grep -v "Generating" | tail -3
done
timeout 150 python -m pytest -q -m gpu tests/quantization/test_triton_kernels.py -k int4 -p no:cacheprovider 2>&1 | tail -3
