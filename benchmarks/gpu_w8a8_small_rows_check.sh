#!/usr/bin/env bash
# fp8 at 2-32 decode rows (W2 batch 16, speculative verify steps) and 160-256: the W8A8
# kernel's GPU tests (swap_ab tiles too), its sweep against the weight-only mma.sync kernel
# and cuBLAS, then where W2 batch 64's step time goes (bf16 and fp8). Results in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_fp8_w8a8.py 2>&1 | tail -4 \
  | tee "$OUT/tests.txt"
timeout "${SWEEP_TIMEOUT:-300}" python benchmarks/gpu_fp8_w8a8_sweep.py --rows "${ROWS:-2,4,8,16,24,32,192,256}" 2>&1 \
  | tee "$OUT/sweep.txt" | grep -E "STEP|failed" | cut -c1-300
for q in fp8 none; do
  flags=(); [ "$q" = none ] || flags=(--quantization "$q")
  timeout 120 python benchmarks/gpu_decode_timeline.py --batch 64 "${flags[@]}" > "$OUT/timeline-b64-$q.txt" 2>&1
  head -30 "$OUT/timeline-b64-$q.txt"
done
