#!/usr/bin/env bash
# Twenty-fifth session, call 4: call 3's first parent run at 3072 cached tokens compiled
# Triton's kernels past the 120 s limit and printed nothing. So the engine's plain and k = 4
# verify steps (verify_cost, int4, llama3-8b dummy) at 3072, parent (ab_base) and this tree
# alternating, two rounds, with a longer limit for the first; then the engine and
# speculative GPU tests (graphs at start now include one sequence's 32-split verify plans).
# Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
BENCH_TIMEOUT=300 ROUNDS=2 verify_rounds "4" --quantization int4 --context-len 3072
timeout 250 python -m pytest -q -m gpu tests/gpu/test_spec_decode_gpu.py tests/gpu/test_engine_gpu.py -p no:cacheprovider \
  > "$OUT/engine_gpu_tests.log" 2>&1
tail -2 "$OUT/engine_gpu_tests.log"; grep -E "^FAILED" "$OUT/engine_gpu_tests.log" | head
true
