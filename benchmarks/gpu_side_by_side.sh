#!/usr/bin/env bash
# One device call: the GPU kernel and engine tests, then W2 (bench latency, batch 1/16/64)
# and W1 (bench throughput, offline-mixed) for kvserve and for transformers (generate,
# generate_batch) on the same random-weight shapes, then one table.
#   SHAPES="llama3-8b qwen2.5-0.5b"  HF_W1_PROMPTS=64 (transformers' W1 request count: 256
#   takes ~4.5 min for llama3-8b alone)  TESTS=1  HF=1  EAGER=0 (1: --enforce-eager)
#   W2_BATCH_SIZES=1,16,64  VARIANT="no-overlap --no-overlap-scheduling" (a name and flags:
#   kvserve runs once more with those flags, reported as SHAPE__name)
source "$(dirname "$0")/device_common.sh"
SHAPES=${SHAPES:-"llama3-8b qwen2.5-0.5b"}
EAGER_FLAG=$([ "${EAGER:-0}" = 1 ] && echo --enforce-eager || true)
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "${TESTS:-1}" = 1 ]; then
  python -m pytest -q -m gpu tests/gpu tests/attention -p no:cacheprovider 2>&1 | tail -4
fi
kvserve_runs() {  # shape, label, extra flags...
  local shape=$1 label=$2
  shift 2
  echo "== kvserve $label"
  python -m kvserve.entrypoints.cli --log-level WARNING bench latency --load-format dummy \
    --model-shape "$shape" --batch-sizes "${W2_BATCH_SIZES:-1,16,64}" $EAGER_FLAG "$@" \
    --output-json "$OUT/kvserve-w2-$label.json" 2>&1 | tail -5
  python -m kvserve.entrypoints.cli --log-level WARNING bench throughput --load-format dummy \
    --model-shape "$shape" --num-prompts 256 --input-len 100 1024 --output-len 100 1024 \
    --no-sequential --no-transformers $EAGER_FLAG "$@" \
    --output-json "$OUT/kvserve-w1-$label.json" 2>&1 | grep -v "Generating" | tail -4
}
for shape in $SHAPES; do
  kvserve_runs "$shape" "$shape"
  if [ -n "${VARIANT:-}" ]; then
    read -r variant_name variant_flags <<< "$VARIANT"
    kvserve_runs "$shape" "${shape}__$variant_name" $variant_flags
  fi
  if [ "${HF:-1}" = 1 ]; then
    echo "== transformers $shape"
    python -m kvserve.benchmarks.transformers_baseline --model-shape "$shape" --w2 \
      --w2-batch-sizes 1,16,64 --w1 --w1-num-prompts "${HF_W1_PROMPTS:-64}" \
      --output-json "$OUT/transformers-$shape.json" 2>&1 | grep -v -i "warn" | tail -5
  fi
done
python -m kvserve.benchmarks.gpu_report "$OUT"
