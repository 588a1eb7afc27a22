#!/usr/bin/env bash
# Perplexity of the embedded SmolLM2 on a held text (Debian's license texts, ~25k tokens)
# for fp32 and each online weight-only quantization. Results: benchmarks/results/quality_*.json
set -euo pipefail
cd "$(dirname "$0")/.."
TEXT=${TEXT:-/tmp/kvserve_quality_text.txt}
cat /usr/share/common-licenses/{GPL-3,GFDL-1.3,Apache-2.0,LGPL-3,MPL-2.0} > "$TEXT"
mkdir -p benchmarks/results
run() {  # name, extra flags...
  local name=$1; shift
  echo "== $name"
  kvserve --log-level WARNING eval perplexity --file "$TEXT" --window 512 --stride 256 \
    --kv-cache-memory 1GiB --output-json "benchmarks/results/quality_$name.json" "$@" 2>&1 \
    | grep -v "Generating\|Loading"
}
run fp32
run int8 --quantization int8
run int4-g64 --quantization int4
run int4-g32 --quantization int4 --quantization-config '{"group_size": 32}'
run nf4 --quantization nf4
run gguf-packed --quantization gguf
run fp8 --quantization fp8
run fp8-kv --kv-cache-dtype fp8
run fp8_e5m2-kv --kv-cache-dtype fp8_e5m2
run serve-auto --quantization auto  # what `kvserve serve` runs: bf16 prefill where AMX makes it fast
