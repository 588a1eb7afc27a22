#!/usr/bin/env bash
# Twenty-fourth session, call 3: the short-context plan up to 2048 keys (32 splits for decode
# steps, 16 for verify widths) against the parent (ab_base). First the attention alone at
# 512-1024 keys, where decode steps now take 32 splits instead of 16; then the engine's plain
# and k = 4 verify steps (verify_cost, int4, llama3-8b dummy) at 1024 and 2048 cached tokens,
# and with an e4m3 cache at 2048. Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
CASES=1:512:1,1:768:1,1:1024:1,2:768:1,2:1024:1 SPLITS=16,32 TILES=32:4 \
  timeout 200 python benchmarks/gpu_verify_attention.py 2>&1 | tee "$OUT/short_splits_under_1024.txt" | grep -v "^ *$"
ROUNDS=1 verify_rounds "4" --quantization int4 --context-len 2048
ROUNDS=1 verify_rounds "4" --quantization int4 --context-len 1024
ROUNDS=1 verify_rounds "4" --quantization int4 --kv-cache-dtype fp8 --context-len 2048
