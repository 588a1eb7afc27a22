#!/usr/bin/env bash
# The sampler's Triton argmax: its GPU tests (with the engine's and the PDL chains'), the
# kernel against torch.argmax (benchmarks/gpu_argmax.py), then W2 int4 and fp8 at batch 1
# in this tree and in ab_base (untracked: mkdir ab_base && git archive <commit> kvserve |
# tar -x -C ab_base). Logs and JSON in $OUT.
source "$(dirname "$0")/device_common.sh"
timeout 300 python -m pytest -q -m gpu tests/sample tests/gpu/test_dependent_launch.py tests/gpu/test_engine_gpu.py \
  -p no:cacheprovider -rA 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed" \
  | tee "$OUT/gpu_tests.log" | tail -25
timeout 120 python benchmarks/gpu_argmax.py 2>&1 | tee "$OUT/argmax.txt"
for q in int4 fp8; do
  for tree in . ab_base; do
    TAIL=2 bench_tree $tree w2-$q latency --batch-sizes 1 --input-len 128 --output-len 128 --quantization $q
  done
done
