#!/usr/bin/env bash
# Device calls for the attention's in-kernel split merge (the last split of a query block
# merges the partials; no second kernel). PART=1: the GPU attention tests, then W2 batch 1
# int4 on llama3-8b dummy weights, the parent tree (ab_base) against this one, two rounds.
# PART=2: the same for fp8 weights, and at 896-1024 keys for int4. Make the parent first:
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
source "$(dirname "$0")/device_common.sh"
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
if [ "${PART:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python -m pytest -q -x -m gpu -p no:cacheprovider tests/attention 2>&1 | tail -3
  ab_rounds w2-int4 $W2 --quantization int4
else
  ab_rounds w2-fp8 $W2 --quantization fp8
  ROUNDS=1 ab_rounds w2-int4-896 latency --batch-sizes 1 --input-len 896 --output-len 128 --quantization int4
fi
