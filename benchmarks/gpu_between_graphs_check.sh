#!/usr/bin/env bash
# One device call: fewer operations between two decode graphs (the greedy argmax inside the
# graph, one input copy, block tables only when changed) and RoPE fused into the KV write.
# The rotary attention cases and the engine tests against transformers and of CUDA graphs,
# then W2 batch 1 on llama3-8b dummy weights, three trees taking turns: the parent of both
# changes (ab_base), the graph change alone (ab_graph) and this tree. ROUNDS (default 2) of
# int4, one of fp8.
# Make the trees first, untracked, in the repository root:
#   mkdir ab_base ab_graph
#   git archive 18a1593 kvserve | tar -x -C ab_base
#   git archive 2995efc kvserve | tar -x -C ab_graph
source "$(dirname "$0")/device_common.sh"
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/attention/test_triton_attention.py -k rotary 2>&1 | tail -2
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  -k "transformers or cuda_graph" 2>&1 | tail -2
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
for round in $(seq "${ROUNDS:-2}"); do
  for tree in ab_base ab_graph .; do bench_tree $tree w2-int4-$round $W2 --quantization int4; done
done
for tree in ab_base ab_graph .; do bench_tree $tree w2-fp8-1 $W2 --quantization fp8; done
