#!/usr/bin/env bash
# Twenty-fifth session, call 2: call 1's k-warps trees took the k-warps config for qkv too
# (alone, qkv is fastest on the default). Here only the 4096-wide linears (o_proj and down,
# both leave the next norm pending) take it, qkv keeps the default: kw3 16 rows, 4 warps,
# k_warps 4, waves 6 (alone: o 10.96 -> 9.99 us, down 28.38 -> 27.09); kw4 32 rows, 4 warps,
# k_warps 2, waves 6 (o 10.86, down 27.37). W2 fp8, two rounds against the parent
# (ab_base); the fixed k-warps GPU test first. Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
route_tree() {  # route_tree NAME CONFIG: this tree's kvserve with CONFIG for fp8's one-row 4096-wide linears
  rm -rf "$1" && mkdir "$1" && cp -r kvserve "$1/"
  python - "$1/kvserve/quantization/weight_only/configs.py" "$2" <<'PY'
import sys
path, config = sys.argv[1:]
text = open(path).read()
old = '    if rows == 1 and out_features >= WIDE_AT_ONE_ROW_OUT_FEATURES:\n'
assert old in text
new = f'    if fp8 and mma and rows == 1 and out_features == 4096:\n        return {config}\n' + old
open(path, "w").write(text.replace(old, new))
PY
}
route_tree kw3 'LaunchConfig(8, 16, 128, num_warps=4, num_stages=1, waves=6, words="mma", even_splits=True, k_warps=4)'
route_tree kw4 'LaunchConfig(8, 32, 128, num_warps=4, num_stages=1, waves=6, words="mma", even_splits=True, k_warps=2)'
timeout 200 python -m pytest -q -m gpu tests/quantization/test_triton_kernels.py -k splits_k_among_warps \
  -p no:cacheprovider > "$OUT/k_warps_test.log" 2>&1
tail -2 "$OUT/k_warps_test.log"; grep -E "^E " "$OUT/k_warps_test.log" | head -5
for round in 1 2; do
  for tree in ab_base kw3 kw4; do
    TAIL=2 bench_tree $tree w2-fp8-$round latency --batch-sizes 1 --input-len 128 --quantization fp8
  done
done
