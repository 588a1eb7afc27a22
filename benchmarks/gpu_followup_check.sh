#!/usr/bin/env bash
# What the 2026-11-26 (third) session could not run for lack of device time, in two calls
# that each fit the device tool's 10 minutes (logs in $OUT):
#   PART=1: the quantization GPU tests it did not reach after the 9-32-row mma change (the
#           fp8 mma kernel's odd shapes, CUDA-graph replays, the dense switch, per-token fp8,
#           the int4/int8 unpack including GroupInt8Linear's new path, the layers at 24 rows),
#           then GroupInt8Linear's dense path timed: torch dequantize vs unpack_weight, + cuBLAS.
#   PART=2: tests/gpu (engine, PDL, quantized engine, speculative decoding).
source "$(dirname "$0")/device_common.sh"
if [ "${PART:-1}" = 1 ]; then
  timeout 420 python -m pytest -q -m gpu tests/quantization/test_triton_kernels.py -p no:cacheprovider \
    -k "fp8_mma or replay or switch_off or per_token or repacked or unpack or layers_match" \
    > "$OUT/gpu_tests_part1.log" 2>&1
  tail -3 "$OUT/gpu_tests_part1.log"
  timeout 150 python benchmarks/gpu_int4_many_rows.py --format int8 --rows 128,512,2048
else
  timeout 560 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider > "$OUT/gpu_tests_part2.log" 2>&1
  tail -3 "$OUT/gpu_tests_part2.log"
fi
