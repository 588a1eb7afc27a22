source benchmarks/device_common.sh
timeout 300 python -m pytest -q -x -m gpu -p no:cacheprovider tests/gpu 2>&1 | tail -3
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
for round in 1 2 3; do
  bench_tree ab_base "w2-int4-$round" $W2 --quantization int4
  bench_tree . "w2-int4-$round" $W2 --quantization int4
done
MID="latency --batch-sizes 1,2 --input-len 384 --output-len 128"
bench_tree ab_base w2-int4-384 $MID --quantization int4
bench_tree . w2-int4-384 $MID --quantization int4
