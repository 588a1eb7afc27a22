#!/usr/bin/env bash
# Twenty-fourth session, call 7: the GPU tests of the short-context plan (decode and verify
# scenarios, now to 2048 and 4096 keys), the warm-up test, and the engine's speculative and
# CUDA-graph tests with every short-context graph captured at start. Logs in $OUT.
source "$(dirname "$0")/../../device_common.sh"
timeout 380 python -m pytest -q -m gpu tests/attention/test_triton_attention.py -k "short or verify or warm_up" \
  -p no:cacheprovider > "$OUT/attention_gpu_tests.log" 2>&1
tail -2 "$OUT/attention_gpu_tests.log"; grep -E "^FAILED" "$OUT/attention_gpu_tests.log" | head
timeout 200 python -m pytest -q -m gpu tests/gpu/test_spec_decode_gpu.py tests/gpu/test_engine_gpu.py -p no:cacheprovider \
  > "$OUT/engine_gpu_tests.log" 2>&1
tail -2 "$OUT/engine_gpu_tests.log"; grep -E "^FAILED" "$OUT/engine_gpu_tests.log" | head
true
