#!/usr/bin/env bash
# SwiGLU in the fp8 gate/up kernel's epilogue at one row (twenty-first session): the kernel
# and engine tests, then W2 fp8 (standard: batch 1, 128 prompt, 256 output tokens) against
# the parent tree, alternating. Make the parent tree first, untracked, in the repository root:
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
# Results in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout "${TEST_TIMEOUT:-200}" python -m pytest -v -rf -m gpu -p no:cacheprovider \
  tests/quantization/test_swiglu_epilogue.py \
  tests/gpu/test_quantized_engine_gpu.py::test_swiglu_in_the_gate_up_epilogue_changes_no_bit \
  "tests/quantization/test_fused_norm.py::test_gpu_fused_norm_chain_matches_unfused" > "$OUT/tests.txt" 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " "$OUT/tests.txt" | tail -15
BENCH_TIMEOUT=150 TAIL=2 ROUNDS=${ROUNDS:-2} ab_rounds w2-fp8 latency --batch-sizes 1 --input-len 128 --quantization fp8
