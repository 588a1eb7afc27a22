#!/usr/bin/env bash
# Twenty-fourth session, call 11: call 10's parent ran out of memory in `bench latency` (its
# graphs' logits held ~4 GiB past the budget), so both trees again at
# --gpu-memory-utilization 0.85, alternating, two rounds: W2 with int4 g128. JSON in $OUT.
source "$(dirname "$0")/../../device_common.sh"
TAIL=2 ab_rounds w2-int4-085 latency --batch-sizes 1 --input-len 128 --quantization int4 --gpu-memory-utilization 0.85
