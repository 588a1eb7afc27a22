"""What the sliced vision towers share (qwen_vision_slices.py, llava_vision_slices.py):
attention of a run of rows, once the whole block's queries, keys and values are known."""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F


def segment_attention(qkv: torch.Tensor, segment_starts: list[int], start: int, end: int,
                      scale: float) -> torch.Tensor:
    """Rows [start, end) attending to every row of their own segment (an image, or a window
    of one). `qkv`: [3, rows, heads, head dim]; `segment_starts`: each segment's first row,
    then the row count. Returns [end - start, heads * head dim]."""
    outputs = []
    first = bisect.bisect_right(segment_starts, start) - 1
    for index in range(first, len(segment_starts) - 1):
        seg_start, seg_end = segment_starts[index], segment_starts[index + 1]
        if seg_start >= end:
            break
        lo, hi = max(seg_start, start), min(seg_end, end)
        if lo >= hi:
            continue
        q = qkv[0, lo:hi].transpose(0, 1)[None]  # [1, heads, rows, head dim]
        k = qkv[1, seg_start:seg_end].transpose(0, 1)[None]
        v = qkv[2, seg_start:seg_end].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        outputs.append(out[0].transpose(0, 1).reshape(hi - lo, -1))
    return torch.cat(outputs)
