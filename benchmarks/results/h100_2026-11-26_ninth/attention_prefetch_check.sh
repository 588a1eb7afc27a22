#!/usr/bin/env bash
# One device call: paged attention at narrow decode batches asking for its first K/V tile in
# L2 before its PDL wait. The GPU attention matrix, then W2 batch 1 on llama3-8b dummy
# weights (int4 twice, bf16 once), the parent tree (ab_base) against this one, alternating.
# Make the parent tree first:
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
source "$(dirname "$0")/device_common.sh"
timeout "${TEST_TIMEOUT:-300}" python -m pytest -q -x -m gpu -p no:cacheprovider \
  tests/attention/test_triton_attention.py 2>&1 | tail -3
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
for round in $(seq "${ROUNDS:-2}"); do
  bench_tree ab_base "w2-int4-$round" $W2 --quantization int4
  bench_tree . "w2-int4-$round" $W2 --quantization int4
done
bench_tree ab_base w2-bf16 $W2
bench_tree . w2-bf16 $W2
