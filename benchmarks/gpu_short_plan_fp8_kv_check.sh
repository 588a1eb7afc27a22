#!/usr/bin/env bash
# One device call: the short-context attention plan (choose_decode_plan) for float8 KV caches
# too. The GPU attention tests and the engine's float8-cache test, then W2 batch 1 on
# llama3-8b dummy weights with int4 weights and an e4m3 cache at 128-256 and 896-1024 keys,
# the parent tree (ab_base) against this one, alternating. Make the parent tree first:
#   mkdir ab_base && git archive <parent> kvserve | tar -x -C ab_base
source "$(dirname "$0")/device_common.sh"
timeout "${TEST_TIMEOUT:-300}" python -m pytest -q -x -m gpu -p no:cacheprovider \
  tests/attention tests/gpu/test_engine_gpu.py -k "fp8 or float8 or e4m3 or e5m2 or warm_up" 2>&1 | tail -3
ab_rounds w2-int4-fp8kv latency --batch-sizes 1 --input-len 128 --output-len 128 --quantization int4 \
  --kv-cache-dtype fp8
ROUNDS=1 ab_rounds w2-int4-fp8kv-896 latency --batch-sizes 1 --input-len 896 --output-len 128 \
  --quantization int4 --kv-cache-dtype fp8
