#!/usr/bin/env bash
# The split-K W8A8 kernel for fp8 at 17-128 decode rows: its sweep against cuBLAS and the
# weight-only kernels, its GPU tests, then W1 with fp8 + fp8 KV in the parent tree (ab_base,
# `mkdir ab_base && git archive HEAD~N kvserve | tar -x -C ab_base`) and this one, and W1
# bf16 once. Results in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout "${SWEEP_TIMEOUT:-240}" python benchmarks/gpu_fp8_w8a8_sweep.py 2>&1 | tee "$OUT/sweep.txt" \
  | grep -E "STEP|failed" | cut -c1-300
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_fp8_w8a8.py 2>&1 | tail -4 \
  | tee "$OUT/tests.txt"
ROUNDS=1 ab_rounds w1-fp8-fp8kv $W1_ARGS --quantization fp8 --kv-cache-dtype fp8
bench_tree . w1-bf16 $W1_ARGS
