#!/usr/bin/env bash
# Twenty-fifth session, call 3: one sequence's verify step past 2048 keys on 32 KV splits
# (LONG_VERIFY_CONTEXT; it had 16). The attention alone at 2048-4000 cached tokens, 16 against
# 32 splits; then the engine's plain and k = 4 verify steps (verify_cost, int4, llama3-8b
# dummy) at 3072 and 4000 cached tokens, the parent (ab_base) and this tree; then the GPU
# attention tests of the verify scenarios (a new one: one sequence at 3000 keys). Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
CASES=1:2048:5,1:2560:5,1:3072:5,1:4000:5 SPLITS=16,32 TILES=32:4 \
  timeout 150 python benchmarks/gpu_verify_attention.py 2>&1 | tee "$OUT/long_verify_splits.txt" | grep -v "^ *$"
ROUNDS=1 verify_rounds "4" --quantization int4 --context-len 3072
ROUNDS=1 verify_rounds "4" --quantization int4 --context-len 4000
timeout 200 python -m pytest -q -m gpu tests/attention/test_triton_attention.py -k "verify_short" \
  -p no:cacheprovider > "$OUT/verify_attention_tests.log" 2>&1
tail -2 "$OUT/verify_attention_tests.log"; grep -E "^FAILED" "$OUT/verify_attention_tests.log" | head
true
