#!/usr/bin/env bash
# One benchmark over several revisions of kvserve in one device call, in rounds (A B C, A B C),
# so that every comparison shares a machine, its clocks and its warm compile caches.
#
#   bash benchmarks/gpu_trees_ab.sh prepare REV...   # here: trees/NAME, REV's kvserve and tests
#   bash benchmarks/gpu_trees_ab.sh run [TREE...]    # on the device: CMD in each tree, ROUNDS times
#   bash benchmarks/gpu_trees_ab.sh tests TREE       # on the device: that tree's GPU tests named in GPU_TESTS
#
# `prepare` extracts each revision (a branch, tag or commit; NAME is REV with / as -) with git
# archive into trees/, which git ignores: pass it to the device tool's carry (["trees"]) and
# `rm -rf trees` when done. `run` takes the working tree itself as the tree named `.`; with no
# TREE it runs `.` and every trees/NAME.
#
# Environment:
#   ROUNDS      rounds over the trees (default 2)
#   CMD         what each tree runs from its own folder (default: W2 at batch 1 on the
#               qwen3-30b-a3b shape, random weights)
#   GPU_TESTS   pytest arguments for `tests` (default: the mixture-of-experts GPU tests)
#   OUT         where trees.txt (every run's last lines, by tree) goes (default /tmp/kvserve-gpu)
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ] || [ $# -eq 0 ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  [ $# -gt 0 ]; exit $?
fi
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/kvserve-gpu}
CMD=${CMD:-"python -m kvserve.entrypoints.cli --log-level WARNING bench latency --load-format dummy \
--model-shape qwen3-30b-a3b --batch-sizes 1"}
GPU_TESTS=${GPU_TESTS:-"-m gpu tests/ops/test_fused_moe.py tests/ops/test_moe_routing.py \
tests/ops/test_moe_fused_norm.py tests/gpu/test_engine_gpu.py::test_mixture_of_experts_greedy_matches_transformers_on_gpu"}
mode=$1
shift
case $mode in
  prepare)
    for rev in "$@"; do
      dir=trees/${rev//\//-}
      rm -rf "$dir" && mkdir -p "$dir"
      git archive "$rev" kvserve tests | tar -x -C "$dir" || exit 1
      echo "$dir: $(git rev-parse --short "$rev") $(git log -1 --format=%s "$rev" | cut -c1-80)"
    done
    ;;
  run)
    mkdir -p "$OUT"
    trees=("$@")
    [ ${#trees[@]} -eq 0 ] && trees=(. trees/*/)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$OUT/trees.txt"
    for round in $(seq "${ROUNDS:-2}"); do
      for tree in "${trees[@]}"; do
        echo "== round $round: ${tree%/}" | tee -a "$OUT/trees.txt"
        (cd "$ROOT/$tree" && PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout 300 bash -c "$CMD" 2>&1 | tail -4) \
          | tee -a "$OUT/trees.txt"
      done
    done
    ;;
  tests)
    mkdir -p "$OUT"
    # shellcheck disable=SC2086  # GPU_TESTS is a list of pytest arguments
    (cd "$ROOT/$1" && PYTHONPATH=$PWD python -m pytest -v -p no:cacheprovider $GPU_TESTS 2>&1 | tail -40) \
      | tee -a "$OUT/trees-tests.txt"
    ;;
  *)
    echo "unknown mode $mode (prepare, run, tests)" >&2
    exit 2
    ;;
esac
