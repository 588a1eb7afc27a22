# Sourced by the one-call device scripts: the repository root as working directory and import
# path, results under $OUT (the device tool's folder), and which GPU this is.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvserve-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ROOT=$PWD
W1_ARGS="throughput --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --no-sequential --no-transformers"
# bench_tree TREE NAME ARGS...: one `kvserve bench ARGS` on llama3-8b dummy weights with the
# kvserve package under TREE ("." is this tree; A/B scripts make an untracked ab_base with
# `mkdir ab_base && git archive <commit> kvserve | tar -x -C ab_base`; on the device HEAD~1
# worked and HEAD~3 was "not a valid object name", so unpack older commits here before the
# call: an untracked ab_base travels with the tree), JSON in
# $OUT/NAME-TREE.json. Each tree runs from its own directory: `python -m` puts the working
# directory first on sys.path, so PYTHONPATH alone would import the root's kvserve.
bench_tree() {
  local tree=$1 name=$2 label
  shift 2
  if [ "$tree" = . ]; then label=this; else label=$(basename "$tree"); fi
  echo "== $name tree=$tree"
  (cd "$ROOT/$tree" && PYTHONPATH=$PWD timeout "${BENCH_TIMEOUT:-200}" python -m kvserve.entrypoints.cli \
     --log-level WARNING bench "$@" --load-format dummy --model-shape llama3-8b \
     --output-json "$OUT/$name-$label.json" 2>&1 | grep -v Generating | tail -"${TAIL:-3}")
}
# ab_rounds NAME ARGS...: bench_tree of the parent tree (ab_base) and of this one, alternating,
# ROUNDS times (default 2): $OUT/NAME-ROUND-ab_base.json and $OUT/NAME-ROUND-this.json.
ab_rounds() {
  local name=$1 round
  shift
  for round in $(seq "${ROUNDS:-2}"); do
    bench_tree ab_base "$name-$round" "$@"
    bench_tree . "$name-$round" "$@"
  done
}
# verify_rounds KS ARGS...: `python -m kvserve.benchmarks.verify_cost` (llama3-8b dummy
# weights, -k each of KS, a space-separated list) under ab_base and this tree, alternating,
# ROUNDS times (default 2); its last line each, appended to $OUT/verify_cost.txt. The first run on
# a fresh machine compiles Triton's kernels for ~100 s (a 120 s limit cut one off), hence 300 s.
verify_rounds() {
  local ks=$1 round tree k
  shift
  for round in $(seq "${ROUNDS:-2}"); do
    for tree in ab_base .; do
      for k in $ks; do
        echo "== round $round tree $tree k=$k" | tee -a "$OUT/verify_cost.txt"
        (cd "$ROOT/$tree" && PYTHONPATH=$PWD timeout "${BENCH_TIMEOUT:-300}" python -m kvserve.benchmarks.verify_cost \
           --load-format dummy --model-shape llama3-8b -k "$k" "$@" 2>&1 | grep -v Generating | tail -1 \
           | tee -a "$OUT/verify_cost.txt")
      done
    done
  done
}
