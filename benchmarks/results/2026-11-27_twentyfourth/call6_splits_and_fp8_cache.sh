#!/usr/bin/env bash
# Twenty-fourth session, call 6: decode split counts where a power of two above the tile count
# leaves splits empty (257-640 keys: 8, 16, 32 splits); then the short plan past 1024 keys over
# an e4m3 cache (not fused: RoPE and the cache write run first), the engine's plain and k = 4
# verify steps (int4 weights) at 1536 and 3072 cached tokens against the parent. Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
CASES=1:257:1,1:384:1,1:513:1,1:640:1,2:640:1 SPLITS=8,16,32 TILES=32:4 \
  timeout 200 python benchmarks/gpu_verify_attention.py 2>&1 | tee "$OUT/short_splits_257_to_640.txt" | grep -v "^ *$"
for context in 1536 3072; do
  ROUNDS=1 verify_rounds "4" --quantization int4 --kv-cache-dtype fp8 --context-len $context
done
