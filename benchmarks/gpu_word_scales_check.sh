#!/usr/bin/env bash
# The int4 word kernel's group scales moved into its tile layout as int64 pairs (BENCHMARKS.md,
# seventeenth session): the word and mma kernels' GPU tests, then W2 int4 against the parent
# tree, alternating, ROUNDS times (default 3). Run after
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
# Log, JSON and test output in $OUT.
source "$(dirname "$0")/device_common.sh"
exec > >(tee "$OUT/log.txt") 2>&1
T=tests/quantization
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider $T/test_triton_kernels.py $T/test_fused_norm.py \
  -k "(gpu_layers_match and int4) or (gpu_fused_norm_chain and g128) or (replay and int4)" 2>&1 | tail -4
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider \
  "$T/test_triton_kernels.py::test_gpu_sweep_configs_match_reference[int4-1]" 2>&1 | tail -4
ROUNDS=${ROUNDS:-3} ab_rounds w2-int4 latency --batch-sizes 1 --input-len 128 --output-len 128 --quantization int4
