#!/usr/bin/env bash
# fp8 at 2-16 decode rows on the W8A8 kernel's 16-row tile (swap_ab) against the weight-only
# mma.sync kernel: one step's linears (CUDA-graph replays over weight copies), the GPU tests,
# then W2 at batch 4 and 16 with fp8 in the parent tree (ab_base, `mkdir ab_base && git
# archive HEAD kvserve | tar -x -C ab_base`) and this one. Results in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout 200 python -m kvserve.entrypoints.cli --log-level WARNING bench quantized-linears --rows 2,4,8,16 \
  --formats bf16,fp8-triton,fp8-w8a8 --output-json "$OUT/linears.json" 2>&1 | tee "$OUT/linears.txt" | grep "^rows"
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_fp8_w8a8.py \
  tests/gpu/test_quantized_engine_gpu.py 2>&1 | tail -4 | tee "$OUT/tests.txt"
ROUNDS=${ROUNDS:-1} BENCH_TIMEOUT=90 TAIL=4 ab_rounds w2-b4-b16-fp8 latency --batch-sizes 4,16 --input-len 128 \
  --quantization fp8
