#!/usr/bin/env bash
# CPU serving side by side: llama.cpp's llama-server vs `kvserve serve` on the embedded
# SmolLM2 Q4_1 GGUF, same thread count, one server at a time, both driven by
# `kvserve bench serve`. Builds llama-server once from the llama-cpp-python sdist and caches
# it in $KVSERVE_LLAMA_CPP_DIR (default ~/.cache/kvserve/llama.cpp).
#   bash benchmarks/cpu_vs_llamacpp.sh            # full run (~6-10 min on 2 quiet cores, build cached)
#   bash benchmarks/cpu_vs_llamacpp.sh --quick    # smoke: kvserve only, 4 requests, no build
# Other flags: python -m kvserve.entrypoints.cli bench cpu-compare --help
# Results: benchmarks/results/cpu_vs_llamacpp*.json (cpu_quick*.json for --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python -m kvserve.entrypoints.cli bench cpu-compare "$@"
