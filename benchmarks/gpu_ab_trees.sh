#!/usr/bin/env bash
# One device call comparing kvserve trees side by side on llama3-8b dummy weights (H200/H100):
# W1 int4 with unpack_int4 (this tree) against the torch dequantize path (ab_base), W2 int4
# batch 1 and W1 bf16 with and without RoPE fused into the KV write (ab_fused), as run on
# 2026-11-26. Make the trees first, untracked, in the repository root:
#   mkdir ab_base ab_fused
#   git archive c75faff kvserve | tar -x -C ab_base
#   git archive 894ea46 kvserve | tar -x -C ab_fused
source "$(dirname "$0")/device_common.sh"
ROOT=$PWD
# Each tree runs from its own directory: `python -m` puts the working directory first on
# sys.path, so PYTHONPATH alone would import the repository root's kvserve.
bench() {  # tree, name, bench args...
  local tree=$1 name=$2; shift 2
  echo "== $name tree=$tree"
  (cd "$ROOT/$tree" && PYTHONPATH=$PWD timeout 170 python -c "import kvserve; print('kvserve from', kvserve.__file__)" && \
   PYTHONPATH=$PWD timeout 170 python -m kvserve.entrypoints.cli --log-level WARNING bench "$@" \
     --load-format dummy --model-shape llama3-8b 2>&1 | grep -v Generating | tail -3)
}
W1="throughput --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --no-sequential --no-transformers"
W2="latency --batch-sizes 1 --input-len 128 --output-len 128"
bench . w1-int4-unpack $W1 --quantization int4
bench ab_base w1-int4-torch-dequant $W1 --quantization int4
bench ab_base w2-int4 $W2 --quantization int4
bench ab_fused w2-int4 $W2 --quantization int4
bench ab_fused w1-bf16-warmup $W1
bench ab_base w1-bf16 $W1
bench ab_fused w1-bf16 $W1
