#!/usr/bin/env bash
# One device call: the GPU tests, then W2 (batch 1) and W1 (offline-mixed, WORKLOADS.md) on
# dummy weights through the engine. ATTN=torch|triton|auto picks the attention backend.
# Results land in $OUT.
source "$(dirname "$0")/device_common.sh"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
git rev-parse --short HEAD 2>/dev/null || true
python -m pytest -q -m gpu tests/gpu tests/attention -p no:cacheprovider 2>&1 | tail -5
ATTN=${ATTN:-auto}
for shape in qwen2.5-0.5b llama3-8b; do
  echo "== W2-like $shape: one request, 128 in / 256 out"
  python -m kvserve.entrypoints.cli --log-level WARNING bench throughput \
    --load-format dummy --model-shape "$shape" --num-prompts 1 --input-len 128 128 \
    --output-len 256 256 --no-sequential --no-transformers --attention-backend "$ATTN" \
    --output-json "$OUT/w2-$shape-$ATTN.json" 2>&1 | grep -v "Generating" | tail -2
  echo "== W1 $shape"
  timeout "${W1_TIMEOUT:-240}" python -m kvserve.entrypoints.cli --log-level INFO bench throughput \
    --load-format dummy --model-shape "$shape" --num-prompts 256 --input-len 100 1024 \
    --output-len 100 1024 --no-sequential --no-transformers --attention-backend "$ATTN" \
    --output-json "$OUT/w1-$shape-$ATTN.json" 2>&1 | grep -v "Generating" | tail -8
done
