#!/usr/bin/env bash
# Twenty-third session: verify steps on the short-context attention plan, RoPE and the KV
# write fused. PART=tests: the attention kernel's GPU tests of verify and decode batches, the
# warm-up test, and the engine's speculative greedy test; then the attention alone at verify
# widths (benchmarks/gpu_verify_attention.py). PART=bench: the verify step of the parent
# (ab_base, unpacked locally before the call) and this tree, int4 at k = 4 and 8 and bf16 at
# k = 4, ROUNDS rounds (default 1), after the warm-up test. llama3-8b dummy weights. Results in $OUT.
source "$(dirname "$0")/device_common.sh"
if [ "${PART:-tests}" = tests ]; then
  timeout 330 python -m pytest -q -m gpu -p no:cacheprovider tests/attention/test_triton_attention.py \
    tests/gpu/test_spec_decode_gpu.py -k "verify or decode_short or warm_up" > "$OUT/tests.txt" 2>&1
  tail -15 "$OUT/tests.txt"
  timeout 200 python benchmarks/gpu_verify_attention.py 2>&1 | tee "$OUT/verify_attention.txt"
else
  timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/attention/test_triton_attention.py \
    -k warm_up 2>&1 | tail -3 | tee "$OUT/tests.txt"
  ROUNDS=${ROUNDS:-1} verify_rounds "4 8" --quantization int4
  ROUNDS=${ROUNDS:-1} verify_rounds "4"
fi
