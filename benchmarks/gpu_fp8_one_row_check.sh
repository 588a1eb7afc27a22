#!/usr/bin/env bash
# fp8 weights at one row of x, kernel chosen by linear: the fp8 GPU layer, sweep-config and
# PDL tests, the one-row fp8 sweep twice (run-to-run spread), then W2 fp8 at batch 1 in this
# tree, in ab_base (untracked: mkdir ab_base && git archive <commit> kvserve | tar -x -C
# ab_base) and in this tree again. Logs and JSON in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout 200 python -m pytest -q -m gpu tests/quantization/test_triton_kernels.py tests/gpu/test_dependent_launch.py \
  -p no:cacheprovider -k "(layers_match and fp8) or (sweep and fp8) or dependent or gemvs or row_counts" \
  > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"
for run in 1 2; do
  timeout 150 python -m kvserve.entrypoints.cli --log-level WARNING bench quantized-linears --rows 1 \
    --formats bf16,fp8-triton --sweep --sweep-formats fp8-triton --output-json "$OUT/fp8_one_row_sweep_$run.json" \
    > "$OUT/fp8_one_row_sweep_$run.txt" 2>&1
  tail -2 "$OUT/fp8_one_row_sweep_$run.txt"
done
W2_ARGS="latency --batch-sizes 1 --input-len 128 --output-len 128 --quantization fp8"
TAIL=2 bench_tree . w2-fp8 $W2_ARGS
TAIL=2 bench_tree ab_base w2-fp8 $W2_ARGS
TAIL=2 bench_tree . w2-fp8-again $W2_ARGS
