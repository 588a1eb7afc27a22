#!/usr/bin/env bash
# Twenty-first session: bench latency's "GPU ms" now replays the graph the run replayed most
# (its GPU test, then W2 fp8 at batch 16 and 64, where GPU ms should now read near graph
# p50), and the speculative verify step's device time against a plain decode step (lead 4:
# fp8's 2-16-row verify steps on W8A8), fp8 / int4 / bf16. llama3-8b dummy weights. Results in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_engine_gpu.py::test_latency_times_each_served_decode_graph 2>&1 | tail -3 | tee "$OUT/tests.txt"
BENCH_TIMEOUT=150 TAIL=3 bench_tree . w2-b16-b64-fp8 latency --batch-sizes 16,64 --input-len 128 --quantization fp8
for q in fp8 int4 none; do
  for k in 4 8; do
    flags=(); [ "$q" = none ] || flags=(--quantization "$q")
    echo "== verify $q k=$k"
    timeout 120 python -m kvserve.benchmarks.verify_cost --load-format dummy --model-shape llama3-8b -k $k \
      "${flags[@]}" 2>&1 | grep -v Generating | tail -1 | tee -a "$OUT/verify_cost.txt"
  done
done
