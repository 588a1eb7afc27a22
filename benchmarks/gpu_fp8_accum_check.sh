#!/usr/bin/env bash
# fp8 linears past the decode kernels' rows: torch._scaled_mm with and without fast
# accumulation, and with tensor-wise scales; two device calls (logs and JSON in $OUT):
#   PART=1: the quantization GPU tests of the layers' dense paths (QuantizedLinear.unpacked_matmul),
#           benchmarks/gpu_fp8_gemm.py at W1's decode widths (cuBLAS variants only), and
#           W2 int4's decode step by kernel (benchmarks/gpu_step_kernels.py).
#   PART=2: the _scaled_mm and fp8 layer GPU tests, then W1 with fp8 weights + fp8 KV in this
#           tree and in ab_base (untracked: mkdir ab_base && git archive <commit> kvserve |
#           tar -x -C ab_base), bf16, and this tree's fp8 once more.
source "$(dirname "$0")/device_common.sh"
if [ "${PART:-1}" = 1 ]; then
  timeout 240 python -m pytest -q -m gpu tests/quantization/test_triton_kernels.py -p no:cacheprovider \
    -k "layers_match or unpack or switch_off" > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
  timeout 120 python benchmarks/gpu_fp8_gemm.py --rows 96,128,192,256 --scaled-mm-only 2>&1 \
    | grep -v warn | tee "$OUT/fp8_gemm.txt"
  timeout 150 python benchmarks/gpu_step_kernels.py --quantization int4 2>&1 | grep -v -i warn | tail -28 \
    | tee "$OUT/step_kernels_int4_b1.txt"
else
  timeout 150 python -m pytest -q -m gpu tests/quantization/test_triton_kernels.py -p no:cacheprovider \
    -k "scaled_mm or (layers_match and fp8)" > "$OUT/gpu_tests_fp8.log" 2>&1
  tail -3 "$OUT/gpu_tests_fp8.log"
  bench_tree . w1-fp8-fp8kv $W1_ARGS --quantization fp8 --kv-cache-dtype fp8
  bench_tree ab_base w1-fp8-fp8kv $W1_ARGS --quantization fp8 --kv-cache-dtype fp8
  bench_tree . w1-bf16 $W1_ARGS
  bench_tree . w1-fp8-fp8kv-again $W1_ARGS --quantization fp8 --kv-cache-dtype fp8
fi
