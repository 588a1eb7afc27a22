#!/usr/bin/env bash
# Twenty-third session: the verify step on the short-context plan for the other formats and
# a longer context: fp8 weights over a bf16 and over an fp8 cache (k = 4), int4 at 1024
# cached tokens (k = 4), the parent (ab_base, unpacked locally before the call) against this
# tree, ROUNDS rounds (default 1); then the attention alone at longer contexts. llama3-8b
# dummy weights. Results in $OUT.
source "$(dirname "$0")/device_common.sh"
ROUNDS=${ROUNDS:-1} verify_rounds "4" --quantization fp8
ROUNDS=${ROUNDS:-1} verify_rounds "4" --quantization fp8 --kv-cache-dtype fp8
ROUNDS=${ROUNDS:-1} verify_rounds "4" --quantization int4 --context-len 1024
CASES=1:512:5,1:1024:9,2:1024:5 timeout 150 python benchmarks/gpu_verify_attention.py 2>&1 \
  | tee "$OUT/verify_attention.txt"
