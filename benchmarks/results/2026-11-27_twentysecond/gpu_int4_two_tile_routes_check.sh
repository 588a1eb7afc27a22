#!/usr/bin/env bash
# Twenty-second session: int4 at 9-16 rows routes gate/up (wide) and the narrow linears to
# their own mma.sync configs. The int4 layers' GPU test (llama3-8b's shapes at 12 and 16 rows
# among others), then the verify step (k = 8, 11, 15: 9, 12, 16 rows) of the parent (ab_base,
# unpacked locally from HEAD~1 before the call) and this tree, ROUNDS rounds (default 1).
# llama3-8b dummy weights. Results in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout 260 python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_triton_kernels.py \
  -k "layers_match_reference and int4" 2>&1 | tail -3 | tee "$OUT/tests.txt"
ROUNDS=${ROUNDS:-1} verify_rounds "8 11 15" --quantization int4
