#!/usr/bin/env bash
# The fused mixture-of-experts path on one GPU, in one call: its GPU tests, the tile sweep
# (which writes this GPU's config file in the package), then the standard workloads on
# Mixtral-8x7B- and Qwen3-30B-A3B-shaped random weights: W2 (`kvserve bench latency`, 128
# prompt + 256 output tokens), 64 requests of W1's lengths (w1x64), and W1 (256 requests).
#
#   bash benchmarks/gpu_moe.sh [STAGE...]      stages: tests tune w2 w1x64 w1 (default: all)
#
# Environment: OUT (default /tmp/kvserve-gpu) gets the logs, JSON results and the tuned
# config; SHAPES (default "mixtral-8x7b qwen3-30b-a3b"); QUANT the expert format for the
# tuner and the engine (int4 | fp8; default: as stored); FLAGS extra engine flags;
# W2_BATCH_SIZES (default 1,16,64); TUNE_TOKENS the token counts to tune (default: the tuner's).
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvserve-gpu}
mkdir -p "$OUT"
SHAPES=${SHAPES:-"mixtral-8x7b qwen3-30b-a3b"}
STAGES=${*:-tests tune w2 w1x64 w1}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() {  # kind, shape, label, flags...
  local kind=$1 shape=$2 label=$3
  shift 3
  echo "== $kind $label"
  # shellcheck disable=SC2086
  python -m kvserve.entrypoints.cli --log-level WARNING bench "$kind" --load-format dummy \
    --model-shape "$shape" ${QUANT:+--quantization $QUANT} ${FLAGS:-} "$@" --output-json "$OUT/kvserve-$label.json" 2>&1 \
    | grep -v "Generating" | tail -6
}
for stage in $STAGES; do
  case $stage in
    tests) timeout 300 python -m pytest -v -m gpu -p no:cacheprovider tests/ops/test_fused_moe.py \
             tests/model_executor/test_moe.py 2>&1 \
             | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | tail -30 ;;
    tune) python -m kvserve.benchmarks.tune_fused_moe --model-shape $SHAPES ${QUANT:+--quantization $QUANT} ${TUNE_TOKENS:+--tokens $TUNE_TOKENS} 2>&1 | tee "$OUT/tune.log"
          cp kvserve/ops/configs/fused_moe/*.json "$OUT/" ;;
    w2) for shape in $SHAPES; do
          bench latency "$shape" "w2-$shape" --batch-sizes "${W2_BATCH_SIZES:-1,16,64}"
        done ;;
    w1x64) for shape in $SHAPES; do
          bench throughput "$shape" "w1x64-$shape" --num-prompts 64 --input-len 100 1024 \
            --output-len 100 1024 --no-sequential --no-transformers
        done ;;
    w1) for shape in $SHAPES; do
          bench throughput "$shape" "w1-$shape" --num-prompts 256 --input-len 100 1024 \
            --output-len 100 1024 --no-sequential --no-transformers
        done ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
