#!/usr/bin/env bash
# Twenty-third session: decode and verify steps past the short contexts with KV splits of at
# least 256 keys (MIN_KEYS_PER_SPLIT, was 512): the parent (ab_base, unpacked locally before
# the call) against this tree, int4 at 1024 and 2048 cached tokens, k = 4. llama3-8b dummy
# weights. Results in $OUT.
source "$(dirname "$0")/device_common.sh"
ROUNDS=1 verify_rounds "4" --quantization int4 --context-len 1024
ROUNDS=1 verify_rounds "4" --quantization int4 --context-len 2048
