#!/usr/bin/env bash
# One device call for the mma.sync kernels at 9-64 rows (x tiles of 8 rows sharing each
# unpacked A fragment): their GPU tests (log in $OUT), then the int4 and fp8 sweeps at
# ROWS (default 16,32,64) on llama3-8b's linears, bf16 cuBLAS timed alongside.
source "$(dirname "$0")/device_common.sh"
ROWS=${ROWS:-16,32,64}
timeout 300 python -m pytest -q -m gpu tests/quantization/test_triton_kernels.py -k "mma or sweep or row_counts" \
  -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"
for fmt in int4 fp8-triton; do
  timeout 240 python -m kvserve.entrypoints.cli --log-level WARNING bench quantized-linears --rows "$ROWS" \
    --formats bf16 --sweep --sweep-formats "$fmt" --output-json "$OUT/${fmt}_wide_sweep.json" \
    2>&1 | grep -v "^sweep $fmt [a-z_]*proj" | grep -A12 "^sweep"
done
