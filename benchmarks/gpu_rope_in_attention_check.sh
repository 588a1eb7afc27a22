#!/usr/bin/env bash
# One device call: RoPE and the new K/V's cache write inside the short-context decode
# attention kernel (fuses_new_kv). The rotary attention cases and the warm-up census, the
# engine tests against transformers and of CUDA graphs, then W2 batch 1 on llama3-8b dummy
# weights, the parent tree (ab_base) and this one taking turns: ROUNDS (default 1) of int4
# and of fp8.
# Make the parent tree first, untracked, in the repository root:
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
source "$(dirname "$0")/device_common.sh"
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/attention/test_triton_attention.py \
  -k "rotary or short or warm_up" 2>&1 | tail -3
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  -k "transformers or cuda_graph" 2>&1 | tail -3
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
ab_rounds w2-int4 $W2 --quantization int4
ab_rounds w2-fp8 $W2 --quantization fp8
