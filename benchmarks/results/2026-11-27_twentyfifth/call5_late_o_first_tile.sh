#!/usr/bin/env bash
# Twenty-fifth session, call 5: the eleventh session's open question, why fp8's decode
# attention costs ~1.5 us a layer more than int4's with the same kernel and cache. Its
# hypothesis: fp8's o_proj, a PDL dependent of the attention, loads its first weight tiles
# (8 MB over 512 programs) while the attention runs. Tree `late` (this tree plus
# late_o_first_tile.diff): o_proj (the one-row fp8 mma call that adds the residual with K = N)
# waits before its first tile. W2 fp8 for this tree and `late`, alternating, two rounds.
# Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
rm -rf late && mkdir late && cp -r kvserve late/ && patch -s -p1 -d late < "$(dirname "$0")/late_o_first_tile.diff"
for round in 1 2; do
  for tree in . late; do
    TAIL=2 bench_tree $tree w2-fp8-$round latency --batch-sizes 1 --input-len 128 --quantization fp8
  done
done
