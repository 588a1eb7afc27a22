#!/usr/bin/env bash
# Perplexity of the embedded SmolLM2-135M-Instruct on a held text (Debian's GPL-3, GFDL-1.3,
# Apache-2.0, LGPL-3 and MPL-2.0 license texts: 20,423 tokens; 512-token windows, stride 256),
# for fp32 (the Q4_1 GGUF dequantized, the reference) and each quantization method and KV-cache
# dtype. CPU; each run takes 1.5-3 minutes on 2 cores.
#
#   bash benchmarks/quality_smollm2.sh [RUN...]     # all runs, or only the named ones
#
# Runs: fp32 int8 int4 int4-g32 nf4 gguf-packed fp8 fp8-kv fp8_e5m2-kv serve-auto.
# Results: $RESULTS_DIR/<run>.json (default benchmarks/results/quality-smollm2/), one
# `kvserve eval perplexity --output-json` file each. The text is written to $TEXT
# (default /tmp/kvserve_quality_text.txt).
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi
cd "$(dirname "$0")/.."
TEXT=${TEXT:-/tmp/kvserve_quality_text.txt}
RESULTS_DIR=${RESULTS_DIR:-benchmarks/results/quality-smollm2}
cat /usr/share/common-licenses/{GPL-3,GFDL-1.3,Apache-2.0,LGPL-3,MPL-2.0} > "$TEXT"
mkdir -p "$RESULTS_DIR"
declare -A FLAGS=(
  [fp32]=""
  [int8]="--quantization int8"
  [int4]="--quantization int4"  # default groups: the first of 128, 64, 32 that divides
  [int4-g32]="--quantization int4 --quantization-config {\"group_size\":32}"
  [nf4]="--quantization nf4"
  [gguf-packed]="--quantization gguf"
  [fp8]="--quantization fp8"
  [fp8-kv]="--kv-cache-dtype fp8"
  [fp8_e5m2-kv]="--kv-cache-dtype fp8_e5m2"
  [serve-auto]="--quantization auto"  # what `kvserve serve` runs on CPU
)
RUNS=("$@")
[ ${#RUNS[@]} -gt 0 ] || RUNS=(fp32 int8 int4 int4-g32 nf4 gguf-packed fp8 fp8-kv fp8_e5m2-kv serve-auto)
for name in "${RUNS[@]}"; do
  [ -n "${FLAGS[$name]+set}" ] || { echo "unknown run: $name (see --help)" >&2; exit 2; }
  echo "== $name"
  # shellcheck disable=SC2086  # the flags are words
  python -m kvserve.entrypoints.cli --log-level WARNING eval perplexity --file "$TEXT" --window 512 \
    --stride 256 --kv-cache-memory 1GiB --output-json "$RESULTS_DIR/$name.json" ${FLAGS[$name]} 2>&1 \
    | grep -v "Generating\|Loading"
done
