#!/usr/bin/env bash
# One device call comparing kvserve trees side by side on llama3-8b dummy weights (H200/H100):
# W1 int4 with unpack_int4 (since renamed unpack_weight; this tree) against the torch dequantize path (ab_base), W2 int4
# batch 1 and W1 bf16 with and without RoPE fused into the KV write (ab_fused), as run on
# 2026-11-26. Make the trees first, untracked, in the repository root:
#   mkdir ab_base ab_fused
#   git archive c75faff kvserve | tar -x -C ab_base
#   git archive 894ea46 kvserve | tar -x -C ab_fused
source "$(dirname "$0")/device_common.sh"
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
bench_tree . w1-int4-unpack $W1_ARGS --quantization int4
bench_tree ab_base w1-int4-torch-dequant $W1_ARGS --quantization int4
bench_tree ab_base w2-int4 $W2 --quantization int4
bench_tree ab_fused w2-int4 $W2 --quantization int4
bench_tree ab_fused w1-bf16-warmup $W1_ARGS
bench_tree ab_base w1-bf16 $W1_ARGS
bench_tree ab_fused w1-bf16 $W1_ARGS
