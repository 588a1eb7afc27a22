#!/usr/bin/env bash
# Twenty-fourth session, call 9: every CUDA graph writes its logits into one shared buffer
# (call 8's k = 8 start ran out of memory: each graph kept its own fp32 logits in the pool).
# Start-up time and GPU memory held (gpu_graphs_at_start.py, int4 llama3-8b dummy) at k = 4
# (first run fills Triton's cache), k = 8, and the parent (ab_base) at k = 4; then the engine
# GPU tests (graph decode against eager with logprobs, speculative greedy). Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
for k in 4 8; do
  echo "#### graphs at start, k=$k"
  timeout 240 python benchmarks/gpu_graphs_at_start.py -k $k 2>&1 \
    | grep -E "engine start|graphs captured|CUDA graphs|shapes|a step that|Error" | tee -a "$OUT/graphs_at_start.txt"
done
echo "#### graphs at start, k=4, tree=ab_base"
(cd "$ROOT/ab_base" && PYTHONPATH=$PWD timeout 200 python "$ROOT/benchmarks/gpu_graphs_at_start.py" -k 4 2>&1 \
   | grep -E "engine start|graphs captured|CUDA graphs|shapes|a step that|Error" | tee -a "$OUT/graphs_at_start.txt")
timeout 250 python -m pytest -q -m gpu tests/gpu/test_spec_decode_gpu.py tests/gpu/test_engine_gpu.py -p no:cacheprovider \
  > "$OUT/engine_gpu_tests.log" 2>&1
tail -2 "$OUT/engine_gpu_tests.log"; grep -E "^FAILED" "$OUT/engine_gpu_tests.log" | head
true
