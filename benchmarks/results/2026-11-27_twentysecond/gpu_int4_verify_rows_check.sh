#!/usr/bin/env bash
# Twenty-second session: int4 at 9-16 decode rows on the mma.sync config the 9/12/16-row sweep
# chose (64 weight rows on 2 warps, 2 programs an SM). The GPU kernel tests of the int4 layers
# and mma kernel, then the speculative verify step (k = 8, 11, 15: 9, 12, 16 rows) against a
# plain decode step, the parent tree (ab_base, HEAD~1) and this one alternating, two rounds.
# llama3-8b dummy weights. Results in $OUT.
source "$(dirname "$0")/device_common.sh"
rm -rf ab_base && mkdir ab_base && git archive HEAD~1 kvserve | tar -x -C ab_base
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_triton_kernels.py \
  -k "int4_mma_kernel or (layers_match_reference and int4)" 2>&1 | tail -3 | tee "$OUT/tests.txt"
ROUNDS=2 verify_rounds "8 11 15" --quantization int4
