#!/usr/bin/env bash
# One device call: narrow decode batches over short contexts on 32-key attention tiles split
# about one tile a slice (choose_decode_plan). The GPU attention tests and the engine tests,
# then W2 batch 1 on llama3-8b dummy weights (int4 twice, bf16 once, and int4 at 896-1024
# keys), the parent tree (ab_base) against this one, alternating. Make the parent tree first:
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
source "$(dirname "$0")/device_common.sh"
timeout "${TEST_TIMEOUT:-420}" python -m pytest -q -x -m gpu -p no:cacheprovider \
  tests/attention tests/gpu 2>&1 | tail -3
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
ab_rounds w2-int4 $W2 --quantization int4
ROUNDS=1 ab_rounds w2-bf16 $W2
ROUNDS=1 ab_rounds w2-int4-896 latency --batch-sizes 1 --input-len 896 --output-len 128 --quantization int4
