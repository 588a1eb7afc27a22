#!/usr/bin/env bash
# One device call for RoPE fused into the KV-cache write: the GPU attention, elementwise and
# engine tests, then W2 (llama3-8b dummy, batch 1) with the fused kernel and, back to back,
# with the tree before it (BASE, a directory holding that commit's kvserve package; created by
# `mkdir ab_base && git archive <commit> kvserve | tar -x -C ab_base`, untracked).
# QUANT lists the --quantization values (default: int4 none); W1_ROUNDS=N adds N alternating
# W1 bf16 runs of each tree (base first: its first run also compiles the shared kernels).
source "$(dirname "$0")/device_common.sh"
BASE=${BASE:-ab_base}
timeout "${TEST_TIMEOUT:-300}" python -m pytest -q -m gpu ${TESTS:-tests/attention tests/model_executor/test_triton_ops.py tests/gpu/test_engine_gpu.py} \
  -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"
for quant in ${QUANT:-int4 none}; do
  for tree in fused "$BASE"; do
    path=$([ "$tree" = fused ] && echo "$PWD" || echo "$PWD/$tree")
    echo "== W2 llama3-8b quantization=$quant tree=$tree"
    PYTHONPATH=$path timeout 150 python -m kvserve.entrypoints.cli --log-level WARNING bench latency \
      --load-format dummy --model-shape llama3-8b --batch-sizes 1 --input-len 128 --output-len 128 \
      --quantization "$quant" --output-json "$OUT/w2-$quant-$(basename "$tree").json" 2>&1 \
      | grep -v "Generating" | tail -3
  done
done
for round in $(seq 1 "${W1_ROUNDS:-0}"); do
  for tree in "$BASE" fused; do
    path=$([ "$tree" = fused ] && echo "$PWD" || echo "$PWD/$tree")
    echo "== W1 llama3-8b bf16 tree=$tree round=$round"
    PYTHONPATH=$path timeout 170 python -m kvserve.entrypoints.cli --log-level WARNING bench throughput \
      --load-format dummy --model-shape llama3-8b --num-prompts 256 --input-len 100 1024 \
      --output-len 100 1024 --no-sequential --no-transformers \
      --output-json "$OUT/w1-$(basename "$tree")-$round.json" 2>&1 | grep -v "Generating" | tail -2
  done
done
