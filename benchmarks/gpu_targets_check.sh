#!/usr/bin/env bash
# #6's H100 targets on one machine, this tree: W1 with fp8 weights + fp8 KV and with bf16
# (the ratio), then W2 with int4 g128 and fp8 (batch 1, 128 prompt and 256 output tokens, as
# WORKLOADS.md defines it: `bench latency`'s default output length). JSON in $OUT.
source "$(dirname "$0")/device_common.sh"
bench_tree . w1-fp8-fp8kv $W1_ARGS --quantization fp8 --kv-cache-dtype fp8
bench_tree . w1-bf16 $W1_ARGS
for q in int4 fp8; do
  TAIL=2 bench_tree . w2-$q latency --batch-sizes 1 --input-len 128 --quantization $q
done
