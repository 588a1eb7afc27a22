#!/usr/bin/env bash
# One device call for the mma.sync kernels at 9-32 rows, engine level: `bench latency` at
# batch 1, 16, 32 and 64 (W2's lengths) and W1, int4 and fp8 on llama3-8b dummy weights, this
# tree against ab_base (the tree before; make it untracked in the repository root first:
# mkdir ab_base && git archive <commit> kvserve | tar -x -C ab_base).
source "$(dirname "$0")/device_common.sh"
W2="latency --batch-sizes 1,16,32,64 --input-len 128 --output-len 128"
for fmt in ${W2_FORMATS:-int4 fp8}; do
  TAIL=6 bench_tree . "w2-$fmt" $W2 --quantization $fmt
  TAIL=6 bench_tree ab_base "w2-$fmt" $W2 --quantization $fmt
done
if [ -z "${SKIP_W1:-}" ]; then
  for fmt in ${W1_FORMATS:-int4 fp8}; do
    bench_tree . "w1-$fmt" $W1_ARGS --quantization $fmt
    bench_tree ab_base "w1-$fmt" $W1_ARGS --quantization $fmt
  done
fi
