#!/usr/bin/env bash
# One device call: RMSNorm fused into the fp8 linears around it at one decode row
# (PendingNorm on the fp8 mma.sync and byte kernels). The fused-norm kernel tests, the
# engine-level fp8 decode test, the fp8 PDL chain tests, then W2 batch 1 on llama3-8b dummy
# weights, fp8 and int4, the parent tree (ab_base) against this one (ROUNDS, default 1).
# Make the parent first:
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
source "$(dirname "$0")/device_common.sh"
timeout 170 python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_fused_norm.py 2>&1 | tail -3
timeout 150 python -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_quantized_engine_gpu.py \
  -k "fused_norms and fp8" 2>&1 | grep -E "mean \||passed|failed|Error" | tail -3
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_dependent_launch.py -k fp8 2>&1 | tail -2
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
ROUNDS=${ROUNDS:-1} ab_rounds w2-fp8 $W2 --quantization fp8
ROUNDS=${ROUNDS:-1} ab_rounds w2-int4 $W2 --quantization int4
