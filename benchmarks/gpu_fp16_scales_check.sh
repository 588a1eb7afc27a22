#!/usr/bin/env bash
# One device call: int4 with fp16 scales and minimums on CUDA (Int4Linear.compact_scales).
# The int4 GPU kernel tests first (layers of every shape at 1-200 rows, the unpack pass, the
# mma kernel's references), then W2 batch 1 on llama3-8b dummy weights, the parent tree
# (ab_base, fp32 scales) and this one, twice, interleaved. Make the parent tree first:
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
source "$(dirname "$0")/device_common.sh"
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_triton_kernels.py \
  -k "fp16_scales or unpack or (layers_match and int4) or (sweep and int4)" 2>&1 | tail -4
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu -k "mma and int4" 2>&1 | tail -3
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
for round in 1 2; do
  bench_tree ab_base "w2-int4-fp32-scales-$round" $W2 --quantization int4
  bench_tree . "w2-int4-fp16-scales-$round" $W2 --quantization int4
done
