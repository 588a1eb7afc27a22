#!/usr/bin/env bash
# Twenty-fourth session, call 5: the engine's plain and k = 4 verify steps (int4, llama3-8b
# dummy) with the short plan up to 4096 keys against the parent (ab_base), at 1536 and 4000
# cached tokens, and 3072 again (call 4's plain step there was 1.3% slower). Results in $OUT.
source "$(dirname "$0")/../../device_common.sh"
for context in 1536 3072 4000; do
  ROUNDS=1 verify_rounds "4" --quantization int4 --context-len $context
done
