#!/usr/bin/env bash
# W1 with fp8 + fp8 KV against W1 bf16 on one machine, alternating twice (the ratio #6
# targets), then `kvserve bench quantized-linears` (CUDA-graph replays over weight copies
# that miss L2) for fp8's three paths at W1's decode rows. Results in $OUT.
source "$(dirname "$0")/device_common.sh"
for round in 1 2; do
  bench_tree . w1-bf16-$round $W1_ARGS
  bench_tree . w1-fp8-fp8kv-$round $W1_ARGS --quantization fp8 --kv-cache-dtype fp8
done
timeout 150 python -m kvserve.entrypoints.cli --log-level WARNING bench quantized-linears --rows 17,32,64,128 \
  --formats bf16,fp8-triton,fp8-scaled_mm,fp8-w8a8 --output-json "$OUT/linears.json" 2>&1 | tee "$OUT/linears.txt" \
  | tail -30
