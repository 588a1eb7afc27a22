#!/usr/bin/env bash
# One device call: paged attention loading its sequence's metadata before its PDL wait. The
# GPU attention matrix, then W2 int4 batch 1 and W1 bf16 on llama3-8b dummy weights, the
# parent tree (ab_base) against this one. Make the parent tree first:
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
source "$(dirname "$0")/device_common.sh"
timeout "${TEST_TIMEOUT:-280}" python -m pytest -q -x -m gpu -p no:cacheprovider \
  tests/attention/test_triton_attention.py 2>&1 | tail -3
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
ROUNDS=${ROUNDS:-1} ab_rounds w2-int4 $W2 --quantization int4
ROUNDS=1 ab_rounds w1-bf16 $W1_ARGS
