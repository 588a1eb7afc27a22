#!/usr/bin/env bash
# Float8 KV caches with V converted to fp16 before its shared-memory round trip, and
# BLOCK_SIZE a compile-time constant in the paged attention kernel: two device calls, this
# tree against ab_base (untracked: mkdir ab_base && git archive <commit> kvserve | tar -x -C ab_base).
#   PART=1: the GPU attention tests, then one layer's attention timed in both trees
#           (benchmarks/gpu_kv_cache_attention.py).
#   PART=2: W1 with fp8 weights + fp8 KV and with bf16, both trees back to back.
source "$(dirname "$0")/device_common.sh"
if [ "${PART:-1}" = 1 ]; then
  timeout 300 python -m pytest -q -m gpu tests/attention -p no:cacheprovider > "$OUT/gpu_attention_tests.log" 2>&1
  tail -3 "$OUT/gpu_attention_tests.log"
  for tree in . ab_base; do
    echo "== one layer, tree=$tree"
    (cd "$ROOT/$tree" && PYTHONPATH=$PWD timeout 120 python "$ROOT/benchmarks/gpu_kv_cache_attention.py")
  done
else
  bench_tree . w1-fp8-fp8kv $W1_ARGS --quantization fp8 --kv-cache-dtype fp8
  bench_tree ab_base w1-fp8-fp8kv $W1_ARGS --quantization fp8 --kv-cache-dtype fp8
  bench_tree . w1-bf16 $W1_ARGS
  bench_tree ab_base w1-bf16 $W1_ARGS
fi
