#!/usr/bin/env bash
# For the next GPU session (BENCHMARKS.md, twenty-first session's leads): the engine test of
# the 32-key tile at 64 sequences (written, not yet run on a GPU), then every mma.sync config
# of int4 at 9, 12 and 16 rows (what routing those rows needs). Results in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout 200 python -m pytest -q -s -m gpu -p no:cacheprovider \
  tests/gpu/test_engine_gpu.py::test_wide_short_decode_plan_scores_like_the_wide_tile 2>&1 | tail -4 | tee "$OUT/tests.txt"
timeout 360 python benchmarks/gpu_int4_mma_rows_sweep.py --rows 9,12,16 2>&1 | tee "$OUT/int4_mma_rows.txt" | tail -70
