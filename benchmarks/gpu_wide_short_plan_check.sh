#!/usr/bin/env bash
# Twenty-first session: the 32-key attention tile (with RoPE and the KV write fused) for
# wide decode batches over at most 384 keys, against the parent tree (ab_base),
# W2 at batch 16 and 64 (128 prompt, 256 output tokens: 128-384 keys), bf16 and fp8 weights.
# Make the parent first: mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
source "$(dirname "$0")/device_common.sh"
for q in none fp8; do
  flags=(); [ "$q" = none ] || flags=(--quantization "$q")
  BENCH_TIMEOUT=150 TAIL=3 ROUNDS=${ROUNDS:-1} ab_rounds w2-$q latency --batch-sizes ${BATCHES:-16,64} --input-len 128 "${flags[@]}"
done
