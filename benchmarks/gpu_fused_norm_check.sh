#!/usr/bin/env bash
# One device call: RMSNorm fused into the int4 linears around it at one decode row
# (PendingNorm). W2 batch 1 int4 on llama3-8b dummy weights, the parent tree (ab_base) against
# this one, alternating, with the fused chain's GPU tests (llama3-8b shapes, mma.sync rows)
# between the rounds and the engine-level decode test last. Make the parent tree first:
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
source "$(dirname "$0")/device_common.sh"
W2="latency --batch-sizes 1 --input-len 128 --output-len 128 --quantization int4"
ROUNDS=1 ab_rounds w2-int4-1 $W2
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_fused_norm.py 2>&1 | tail -2
ROUNDS=1 ab_rounds w2-int4-2 $W2
timeout 150 python -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_quantized_engine_gpu.py \
  -k fused_norms 2>&1 | grep -E "mean \||passed|failed|Error" | tail -3
