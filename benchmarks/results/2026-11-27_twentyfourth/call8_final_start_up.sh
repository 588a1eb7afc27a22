#!/usr/bin/env bash
# Twenty-fourth session, call 8: start-up with the final rule (decode graphs to 2048 keys,
# verify widths to 4096): benchmarks/gpu_graphs_at_start.py at k = 4 twice (the first run fills
# Triton's cache on a fresh machine) and k = 8. int4 llama3-8b dummy. Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
for k in 4 4 8; do
  echo "#### graphs at start, k=$k"
  timeout 240 python benchmarks/gpu_graphs_at_start.py -k $k 2>&1 \
    | grep -E "engine start|graphs captured|CUDA graphs|shapes|a step that" | tee -a "$OUT/graphs_at_start.txt"
done
