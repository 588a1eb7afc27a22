#!/usr/bin/env bash
# Every kernel of the decode chain launched under PDL (norms, RoPE, KV write, attention and
# the GEMVs): the GPU tests of PDL, the engine and the attention warm-up, then W2 at batch 1
# (bf16, int4 g128, fp8) with KVSERVE_PDL=0 and 1 back to back. Logs and JSON in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout 330 python -m pytest -q -m gpu tests/gpu/test_dependent_launch.py tests/gpu/test_engine_gpu.py \
  tests/attention/test_triton_attention.py -k "dependent or launch or pdl or engine or greedy or graph or overlap or warm" \
  -p no:cacheprovider -rA 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" | tee "$OUT/gpu_tests.log" | tail -22
for q in none int4 fp8; do
  for pdl in 0 1; do
    echo "== W2 $q KVSERVE_PDL=$pdl"
    KVSERVE_PDL=$pdl TAIL=2 BENCH_TIMEOUT=120 bench_tree . "w2-$q-pdl$pdl" latency --batch-sizes 1 \
      --input-len 128 --output-len 128 --quantization $q
  done
done
