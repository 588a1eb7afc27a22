#!/usr/bin/env bash
# Twenty-fourth session, call 2, on call 1's machine (Triton's cache warm): the parent's
# start-up again (call 1 ran it first, on a cold cache), then the GPU warm-up test, bf16 and
# fp32 (the twenty-third session fixed the warm-up without running it). Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
echo "#### graphs at start, k=4, tree=ab_base (warm Triton cache)"
(cd "$ROOT/ab_base" && PYTHONPATH=$PWD timeout 200 python "$ROOT/benchmarks/gpu_graphs_at_start.py" -k 4 2>&1 \
   | grep -E "engine start|graphs captured|CUDA graphs|shapes|a step that" | tee -a "$OUT/graphs_at_start.txt")
timeout 420 python -m pytest -q -m gpu tests/attention/test_triton_attention.py -k warm_up_leaves -p no:cacheprovider \
  > "$OUT/warm_up_test.log" 2>&1
tail -3 "$OUT/warm_up_test.log"; grep -E "^FAILED|compiled after" "$OUT/warm_up_test.log" | head
