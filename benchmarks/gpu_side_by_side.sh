#!/usr/bin/env bash
# The standard GPU workloads in one call, beside transformers: for each model shape (random
# weights), W2 (`kvserve bench latency`, batch 1/16/64, 128 prompt + 256 output tokens) and W1
# (`kvserve bench throughput`, 256 requests, prompt and output lengths uniform in [100, 1024]),
# then transformers' `generate` (W2) and `generate_batch` (W1) on the same shapes, then one table
# (`python -m kvserve.benchmarks.gpu_report`) with each number's floor.
#
#   bash benchmarks/gpu_side_by_side.sh
#   SHAPES=llama3-8b HF=0 FLAGS="--quantization fp8 --kv-cache-dtype fp8" bash benchmarks/gpu_side_by_side.sh
#
# Environment:
#   OUT               folder for the JSON files (default /tmp/kvserve-gpu)
#   SHAPES            model shapes (default "llama3-8b qwen2.5-0.5b")
#   FLAGS             extra engine flags for every kvserve run, e.g. --quantization int4
#   W2_BATCH_SIZES    W2 batch sizes (default 1,16,64)
#   VARIANT           "NAME FLAGS...": kvserve runs once more with those flags, reported as SHAPE__NAME
#   HF                1 runs transformers (default), 0 skips it
#   HF_W1_PROMPTS     transformers' W1 request count (default 64: 256 takes ~4.5 min on llama3-8b)
#   TESTS             1 runs the GPU engine and attention tests first (default 0)
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvserve-gpu}
mkdir -p "$OUT"
SHAPES=${SHAPES:-"llama3-8b qwen2.5-0.5b"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "${TESTS:-0}" = 1 ]; then
  python -m pytest -q -m gpu tests/gpu tests/attention -p no:cacheprovider 2>&1 | tail -4
fi
kvserve_runs() {  # shape, label, extra flags...
  local shape=$1 label=$2
  shift 2
  echo "== kvserve $label"
  # shellcheck disable=SC2086  # FLAGS is a list of words
  python -m kvserve.entrypoints.cli --log-level WARNING bench latency --load-format dummy \
    --model-shape "$shape" --batch-sizes "${W2_BATCH_SIZES:-1,16,64}" ${FLAGS:-} "$@" \
    --output-json "$OUT/kvserve-w2-$label.json" 2>&1 | tail -5
  # shellcheck disable=SC2086
  python -m kvserve.entrypoints.cli --log-level WARNING bench throughput --load-format dummy \
    --model-shape "$shape" --num-prompts 256 --input-len 100 1024 --output-len 100 1024 \
    --no-sequential --no-transformers ${FLAGS:-} "$@" \
    --output-json "$OUT/kvserve-w1-$label.json" 2>&1 | grep -v "Generating" | tail -4
}
for shape in $SHAPES; do
  kvserve_runs "$shape" "$shape"
  if [ -n "${VARIANT:-}" ]; then
    read -r variant_name variant_flags <<< "$VARIANT"
    # shellcheck disable=SC2086
    kvserve_runs "$shape" "${shape}__$variant_name" $variant_flags
  fi
  if [ "${HF:-1}" = 1 ]; then
    echo "== transformers $shape"
    python -m kvserve.benchmarks.transformers_baseline --model-shape "$shape" --w2 \
      --w2-batch-sizes "${W2_BATCH_SIZES:-1,16,64}" --w1 --w1-num-prompts "${HF_W1_PROMPTS:-64}" \
      --output-json "$OUT/transformers-$shape.json" 2>&1 | grep -v -i "warn" | tail -5
  fi
done
python -m kvserve.benchmarks.gpu_report "$OUT"
