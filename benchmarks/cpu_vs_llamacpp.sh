#!/usr/bin/env bash
# CPU serving side by side: llama.cpp's llama-server against `kvserve serve` on the embedded
# SmolLM2 Q4_1 GGUF, same thread count, one server at a time, both driven by
# `kvserve bench serve`. Builds llama-server once from the llama-cpp-python sdist and caches
# it in $KVSERVE_LLAMA_CPP_DIR (default ~/.cache/kvserve/llama.cpp). A thin wrapper over
# `kvserve bench cpu-compare` that runs this checkout's kvserve; every flag is passed on.
#
#   bash benchmarks/cpu_vs_llamacpp.sh --rounds 3       # full run, 3 alternating rounds
#   bash benchmarks/cpu_vs_llamacpp.sh --points 1-stream --rounds 3 --output-dir DIR --tag NAME
#   bash benchmarks/cpu_vs_llamacpp.sh --quick          # smoke: kvserve only, 4 requests, no build
#
# A full run takes ~6-10 minutes on 2 quiet cores once llama-server is built (~6 minutes).
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  echo
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python -m kvserve.entrypoints.cli bench cpu-compare "$@"
