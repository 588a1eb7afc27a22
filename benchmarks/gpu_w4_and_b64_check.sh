#!/usr/bin/env bash
# For the next GPU session (BENCHMARKS.md, twentieth session's leads 1 and 5): the served-graph
# timing's GPU test, W2 at batch 16 and 64 (bf16 and fp8) with its "graph p50" column beside
# "GPU ms", then W4 shared-prefix with the prefix cache on and off. llama3-8b dummy weights.
# Results in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_engine_gpu.py::test_latency_times_each_served_decode_graph 2>&1 | tail -3 | tee "$OUT/tests.txt"
for q in fp8 none; do
  flags=(); [ "$q" = none ] || flags=(--quantization "$q")
  BENCH_TIMEOUT=120 TAIL=4 bench_tree . w2-b16-b64-$q latency --batch-sizes 16,64 --input-len 128 "${flags[@]}"
done
BENCH_TIMEOUT=240 TAIL=6 bench_tree . w4 prefix
