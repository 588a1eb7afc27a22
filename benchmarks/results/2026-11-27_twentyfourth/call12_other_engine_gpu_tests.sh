#!/usr/bin/env bash
# Twenty-fourth session, call 12: the other GPU tests that build engines with CUDA graphs
# (quantized engines, dependent launches), after the shared logits buffer. Log in $OUT.
source "$(dirname "$0")/../../device_common.sh"
timeout 400 python -m pytest -q -m gpu tests/gpu/test_dependent_launch.py tests/gpu/test_quantized_engine_gpu.py \
  -p no:cacheprovider > "$OUT/other_engine_gpu_tests.log" 2>&1
tail -2 "$OUT/other_engine_gpu_tests.log"; grep -E "^FAILED" "$OUT/other_engine_gpu_tests.log" | head
true
