#!/usr/bin/env bash
# One device call: the int4 mma kernel taking the MLP's SwiGLU in its epilogue and the
# post-attention RMSNorm on its loads of x. Its GPU tests (both against the unfused chain),
# then W2 int4 batch 1 on llama3-8b dummy weights, alternating between the trees in TREES
# (default: the parent tree ab_base, then this one). Make the parent tree first:
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
source "$(dirname "$0")/device_common.sh"
timeout "${TEST_TIMEOUT:-300}" python -m pytest -q -x -m gpu -p no:cacheprovider \
  tests/quantization/test_triton_kernels.py -k "${TESTS:-silu_epilogue or norm_on_load}" 2>&1 | tail -4
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
for round in $(seq "${ROUNDS:-2}"); do
  for tree in ${TREES:-ab_base .}; do
    bench_tree "$tree" "w2-int4-$round" $W2 --quantization int4
  done
done
