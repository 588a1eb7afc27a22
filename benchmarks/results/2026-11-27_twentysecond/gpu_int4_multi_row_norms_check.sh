#!/usr/bin/env bash
# Twenty-second session: int4's mma.sync kernel leaves the RMSNorm pending at 2-32 rows (o_proj
# and down), so a verify step's 64 add + RMSNorm kernels go. PART=tests: the GPU tests of the
# fused chains, the int4 mma kernel and the engine's fused decode (batch 1 and 5). PART=bench:
# the verify step (k = 4, 8, 15: 5, 9, 16 rows) against a plain decode step, the parent tree
# (ab_base, BASE: default HEAD~1) and this one alternating, ROUNDS rounds (default 2). llama3-8b dummy
# weights. Results in $OUT.
source "$(dirname "$0")/device_common.sh"
if [ "${PART:-tests}" = tests ]; then
  timeout 420 python -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/quantization/test_fused_norm.py \
    tests/gpu/test_quantized_engine_gpu.py::test_fused_norms_decode_like_the_unfused_chain \
    "tests/quantization/test_triton_kernels.py::test_gpu_int4_mma_kernel_matches_reference" 2>&1 \
    | tail -20 | tee "$OUT/tests.txt"
  exit
fi
[ "${BASE:-HEAD~1}" = local ] || { rm -rf ab_base && mkdir ab_base && git archive "${BASE:-HEAD~1}" kvserve | tar -x -C ab_base; }
verify_rounds "${KS:-4 8 15}" --quantization int4
