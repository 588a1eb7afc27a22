#!/usr/bin/env bash
# Twenty-fourth session, call 4: call 3's verify_cost ran at 2048 cached tokens, which is 2049+
# keys, past a 2048-key boundary. Here the short plan reaches 4096 keys: the attention alone at
# 2049-4096 keys (16-64 splits), then the engine's plain and k = 4 verify steps (int4) at 2048
# and 3072 cached tokens against the parent (ab_base). Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
CASES=1:2049:1,1:3072:1,1:4096:1,2:3072:1,1:2049:5,1:3072:5,1:4096:5,2:2049:5 SPLITS=16,32,64 TILES=32:4 \
  timeout 200 python benchmarks/gpu_verify_attention.py 2>&1 | tee "$OUT/short_plan_past_2048.txt" | grep -v "^ *$"
ROUNDS=1 verify_rounds "4" --quantization int4 --context-len 2048
ROUNDS=1 verify_rounds "4" --quantization int4 --context-len 3072
