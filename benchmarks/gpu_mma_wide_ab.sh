#!/usr/bin/env bash
# One device call for the mma.sync kernels at 9-32 rows, engine level: `bench latency` at
# batch 1, 16, 32 and 64 (W2's lengths) and W1, int4 and fp8 on llama3-8b dummy weights, this
# tree against ab_base (the tree before; make it untracked in the repository root first:
# mkdir ab_base && git archive <commit> kvserve | tar -x -C ab_base).
source "$(dirname "$0")/device_common.sh"
ROOT=$PWD
# Each tree runs from its own directory: `python -m` puts the working directory first on
# sys.path, so PYTHONPATH alone would import the repository root's kvserve.
bench() {  # tree, name, bench args...
  local tree=$1 name=$2; shift 2
  echo "== $name tree=$tree"
  (cd "$ROOT/$tree" && PYTHONPATH=$PWD timeout 200 python -m kvserve.entrypoints.cli --log-level WARNING bench "$@" \
     --load-format dummy --model-shape llama3-8b --output-json "$OUT/$name-$(basename "$tree").json" 2>&1 \
     | grep -v Generating | tail -${TAIL:-3})
}
W1="throughput --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --no-sequential --no-transformers"
W2="latency --batch-sizes 1,16,32,64 --input-len 128 --output-len 128"
for fmt in ${W2_FORMATS:-int4 fp8}; do
  TAIL=6 bench . "w2-$fmt" $W2 --quantization $fmt
  TAIL=6 bench ab_base "w2-$fmt" $W2 --quantization $fmt
done
if [ -z "${SKIP_W1:-}" ]; then
  for fmt in ${W1_FORMATS:-int4 fp8}; do
    bench . "w1-$fmt" $W1 --quantization $fmt
    bench ab_base "w1-$fmt" $W1 --quantization $fmt
  done
fi
