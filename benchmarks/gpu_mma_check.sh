#!/usr/bin/env bash
# One device call for the mma.sync kernels (FORMAT=int4, the default, or fp8): the GPU tests
# of the quantization methods and the engine (log in $OUT), the format's sweep at 1, 4 and 8
# rows on llama3-8b's linears (SKIP_SWEEP=1 leaves it out), then W2 at batch 1, 4 and 8, with
# the new row rules and, back to back, the ones before them (no mma entries: tl.dot tiles for
# 2-16 rows, the CUDA-core kernel for every one-row linear) swapped in at start-up.
source "$(dirname "$0")/device_common.sh"
FORMAT=${FORMAT:-int4}
SWEEP_FORMAT=$([ "$FORMAT" = fp8 ] && echo fp8-triton || echo "$FORMAT")
# TESTS narrows the GPU tests. (test_gguf_packed needs the gguf package, which the device
# image lacks; it has no GPU tests.)
timeout 420 python -m pytest -q -m gpu ${TESTS:-tests/quantization tests/gpu} \
  --ignore tests/quantization/test_gguf_packed.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"
if [ -z "${SKIP_SWEEP:-}" ]; then
  timeout 300 python -m kvserve.entrypoints.cli --log-level WARNING bench quantized-linears --rows 1,4,8 \
    --formats "bf16,$SWEEP_FORMAT" --sweep --sweep-formats "$SWEEP_FORMAT" --output-json "$OUT/${FORMAT}_mma_sweep.json" \
    2>&1 | grep -v "^sweep $SWEEP_FORMAT [a-z_]*proj" | tail -80
fi
for table in new before; do
  echo "== W2 llama3-8b $FORMAT, row table: $table"
  timeout 150 python - "$table" "$FORMAT" <<'PY' 2>&1 | grep -v "Generating" | tail -4
import os, sys
import kvserve.quantization.weight_only.configs as tk
table, fmt = sys.argv[1:]
if table == "before":
    tk.INT4_DECODE_CONFIGS = tuple(entry for entry in tk.INT4_DECODE_CONFIGS if entry[1].words != "mma")
    tk.FP8_DECODE_CONFIGS = tuple(entry for entry in tk.FP8_DECODE_CONFIGS if entry[1].words != "mma")
    tk.WIDE_AT_ONE_ROW_OUT_FEATURES = 1 << 30
from kvserve.entrypoints.cli import main
main(["--log-level", "WARNING", "bench", "latency", "--load-format", "dummy", "--model-shape", "llama3-8b",
      "--batch-sizes", "1,4,8", "--input-len", "128", "--output-len", "128", "--quantization", fmt,
      "--output-json", os.path.join(os.environ["OUT"], f"w2-{fmt}-{table}.json")])
PY
done
