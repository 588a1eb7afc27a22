#!/usr/bin/env bash
# The int4 word kernel's group scales moved into its tile layout in fewer conversions
# (BENCHMARKS.md, sixteenth session): W2 int4 and llama3-8b's int4 linears alone at one row
# (where the plain kernel variant runs), then the word and mma kernels' GPU tests. Run with
# the packed form applied to this tree and two untracked trees beside it:
#   R=benchmarks/results/2026-11-27_sixteenth/h100_scales_hoisted
#   for d in base pairs; do mkdir ab_$d && git archive HEAD kvserve | tar -x -C ab_$d; done
#   git apply --directory=ab_pairs $R/scale_pairs.diff && git apply $R/word_scales_packed.diff
# Logs and JSON in $OUT.
source "$(dirname "$0")/device_common.sh"
W2="latency --batch-sizes 1 --input-len 128 --output-len 128 --quantization int4"
for round in 1 2; do
  for tree in ab_base . ab_pairs; do
    TAIL=2 bench_tree $tree w2-int4-$round $W2
  done
done
for tree in ab_base . ab_pairs; do
  echo "== linears tree=$tree"
  (cd "$ROOT/$tree" && PYTHONPATH=$PWD timeout 200 python -m kvserve.entrypoints.cli --log-level WARNING bench \
     quantized-linears --rows 1 --formats int4 --output-json "$OUT/linears-$(basename "$tree").json" 2>&1 | tail -8)
done
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/quantization/test_triton_kernels.py \
  tests/quantization/test_fused_norm.py -k "(gpu_layers_match and int4) or gpu_fused_norm_chain or replay or sweep" \
  2>&1 | tail -8
