#!/usr/bin/env bash
# Twenty-fourth session, call 10: W2 with int4 g128 (batch 1, 128 prompt and 256 output
# tokens, `bench latency`'s defaults) for the parent (ab_base) and this tree, alternating, two
# rounds: the logits now land in a shared buffer (`out.copy_` in place of `.float()`) and the
# int4 W2 target has no margin. JSON in $OUT.
source "$(dirname "$0")/../../device_common.sh"
TAIL=2 ab_rounds w2-int4 latency --batch-sizes 1 --input-len 128 --quantization int4
