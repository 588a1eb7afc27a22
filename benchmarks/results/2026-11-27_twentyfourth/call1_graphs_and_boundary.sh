#!/usr/bin/env bash
# Twenty-fourth session, call 1 (llama3-8b dummy weights, int4): what capturing every graph of
# short contexts at start costs against the parent (ab_base, unpacked locally before the call),
# and the steps that captured a graph while serving; then the short-context plan's boundary
# past SHORT_CONTEXT: the attention of a decode / verify step on the short tile at 8-32 splits
# against the default plan (RoPE, KV write, 256-key tile). Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
for tree in ab_base .; do
  echo "#### graphs at start, k=4, tree=$tree"
  (cd "$ROOT/$tree" && PYTHONPATH=$PWD timeout 240 python "$ROOT/benchmarks/gpu_graphs_at_start.py" -k 4 2>&1 \
     | grep -E "engine start|graphs captured|CUDA graphs|shapes|a step that" | tee -a "$OUT/graphs_at_start.txt")
done
echo "#### graphs at start, k=8, this tree"
timeout 240 python benchmarks/gpu_graphs_at_start.py -k 8 2>&1 \
  | grep -E "engine start|graphs captured|CUDA graphs|shapes|a step that" | tee -a "$OUT/graphs_at_start.txt"
echo "#### short plan past SHORT_CONTEXT"
CASES=1:1025:1,1:1536:1,1:2048:1,2:2048:1,1:4096:1,1:1025:5,1:2048:5,2:1536:5 SPLITS=8,16,32 TILES=32:4,64:4 \
  timeout 300 python benchmarks/gpu_verify_attention.py 2>&1 | tee "$OUT/short_plan_boundary.txt" | grep -v "^ *$"
