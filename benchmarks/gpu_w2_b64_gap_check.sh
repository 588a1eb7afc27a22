#!/usr/bin/env bash
# Where W2 batch 64's step time goes past its graph's replayed time: W2 fp8 at batch 16 and
# 64 with overlapped scheduling on (the default) and off, then the profiled timeline at batch
# 16, where the served step equals the replayed graph (is the profiler's busy time inflated?).
# Results in $OUT.
source "$(dirname "$0")/device_common.sh"
for overlap in overlap-scheduling no-overlap-scheduling; do
  BENCH_TIMEOUT=100 TAIL=4 bench_tree . w2-fp8-$overlap latency --batch-sizes 16,64 --input-len 128 \
    --quantization fp8 --$overlap
done
timeout 90 python benchmarks/gpu_decode_timeline.py --batch 16 --quantization fp8 > "$OUT/timeline-b16-fp8.txt" 2>&1
head -12 "$OUT/timeline-b16-fp8.txt" | grep -v Warn
