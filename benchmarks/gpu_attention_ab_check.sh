#!/usr/bin/env bash
# One layer's attention (benchmarks/gpu_kv_cache_attention.py) in this tree and in ab_base
# (untracked: mkdir ab_base && git archive <commit> kvserve | tar -x -C ab_base), alternating,
# twice each, to tell a kernel change from run-to-run noise; then W1's GPU time by kernel
# with fp8 weights + fp8 KV (benchmarks/gpu_w1_kernels.py). Output in $OUT.
source "$(dirname "$0")/device_common.sh"
for round in 1 2; do
  for tree in . ab_base; do
    echo "== round $round, tree=$tree"
    (cd "$ROOT/$tree" && PYTHONPATH=$PWD timeout 120 python "$ROOT/benchmarks/gpu_kv_cache_attention.py" 2>&1 \
      | grep -v -i warn | tee -a "$OUT/one_layer_attention_$(basename "$tree").txt")
  done
done
timeout 240 python benchmarks/gpu_w1_kernels.py --quantization fp8 --kv-cache-dtype fp8 2>&1 | grep -v -i warn \
  | head -30 > "$OUT/w1_kernels_fp8.txt"
head -14 "$OUT/w1_kernels_fp8.txt"
