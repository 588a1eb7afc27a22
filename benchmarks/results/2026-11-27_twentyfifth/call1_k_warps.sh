#!/usr/bin/env bash
# Twenty-fifth session, call 1: fp8's one-row mma kernel with K split among a program's warps
# (LaunchConfig.k_warps, summed in shared memory) instead of only among programs (each split
# ends on a global tail). The new GPU test; the llama3-8b linears alone at one row over the
# k-warps grid; then W2 fp8 (bench latency, batch 1, 128 prompt + 256 output tokens) for the
# parent (ab_base), this tree (default unchanged) and two trees whose one-row default takes
# k_warps (kw1: 16 rows, 4 warps, k_warps 4, waves 6; kw2: 32 rows, 8 warps, k_warps 4,
# waves 4). Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
ORIG='(1, LaunchConfig(8, 128, 128, num_warps=4, num_stages=1, waves=6, words="mma", even_splits=True)),'
make_tree() {  # make_tree NAME CONFIG: a copy of this tree's kvserve with the one-row fp8 default replaced
  rm -rf "$1" && mkdir "$1" && cp -r kvserve "$1/"
  python - "$1/kvserve/quantization/weight_only/configs.py" "$ORIG" "$2" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
assert old in text
open(path, "w").write(text.replace(old, new))
PY
}
make_tree kw1 '(1, LaunchConfig(8, 16, 128, num_warps=4, num_stages=1, waves=6, words="mma", even_splits=True, k_warps=4)),'
make_tree kw2 '(1, LaunchConfig(8, 32, 128, num_warps=8, num_stages=1, waves=4, words="mma", even_splits=True, k_warps=4)),'
timeout 200 python -m pytest -q -m gpu tests/quantization/test_triton_kernels.py -k splits_k_among_warps \
  -p no:cacheprovider > "$OUT/k_warps_test.log" 2>&1
tail -2 "$OUT/k_warps_test.log"
timeout 200 python benchmarks/gpu_one_row_configs.py --formats fp8 --grid k-warps --top 12 2>&1 \
  | tee "$OUT/one_row_k_warps.txt"
for tree in . kw1 kw2 ab_base; do
  TAIL=2 bench_tree $tree w2-fp8 latency --batch-sizes 1 --input-len 128 --quantization fp8
done
