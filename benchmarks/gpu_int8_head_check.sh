#!/usr/bin/env bash
# One device call: the LM-head GPU tests, the head's kernels (benchmarks/gpu_lm_head_kernels.py),
# then W2 batch 1 on llama3-8b dummy weights with int4 and fp8 linears, each with the default
# int8 head copy and with lm_head false (the bf16 head alone), back to back.
source "$(dirname "$0")/device_common.sh"
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_int4_lm_head.py 2>&1 | tail -4
timeout 120 python benchmarks/gpu_lm_head_kernels.py 2>&1 | tee "$OUT/lm_head_kernels.txt"
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
for method in ${METHODS:-int4 fp8}; do
  for head in default false; do
    config=(); [ "$head" = false ] && config=(--quantization-config '{"lm_head": false}')
    bench_tree . "w2-$method-head-$head" $W2 --quantization "$method" "${config[@]}"
  done
done
