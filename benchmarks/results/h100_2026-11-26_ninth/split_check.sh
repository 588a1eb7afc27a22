source benchmarks/device_common.sh
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
for round in 1 2; do
  for tree in ab_base ab_split64 ab_split32; do
    bench_tree $tree "w2-int4-$round" $W2 --quantization int4
  done
done
