#!/usr/bin/env bash
# One device call: the GPU kernel tests with programmatic dependent launch, then W2 batch 1
# on llama3-8b dummy weights with KVSERVE_PDL=0 and 1 alternated, for bf16, int4 and fp8.
source "$(dirname "$0")/device_common.sh"
git rev-parse --short HEAD 2>/dev/null || true
timeout 300 python -m pytest -q -m gpu tests/gpu/test_dependent_launch.py ${TESTS:-tests/quantization/test_triton_kernels.py tests/attention} \
  -p no:cacheprovider -x 2>&1 | tail -4
for quant in ${QUANTS:-int4 fp8 none}; do
  for pdl in 0 1; do
    echo "== W2 llama3-8b quantization=$quant KVSERVE_PDL=$pdl"
    KVSERVE_PDL=$pdl timeout 200 python -m kvserve.entrypoints.cli --log-level WARNING bench latency --load-format dummy \
      --model-shape llama3-8b --batch-sizes 1 --input-len 128 --output-len 128 --quantization "$quant" \
      --output-json "$OUT/w2-$quant-pdl$pdl.json" 2>&1 | grep -v "Generating" | tail -3
  done
done
