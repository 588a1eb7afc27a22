"""What the sliced vision towers share (qwen_vision_slices.py, llava_vision_slices.py):
attention of a run of rows, once the whole block's queries, keys and values are known, and
the loop that advances a tower's state by a number of row-passes."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def segment_attention(qkv: torch.Tensor, segment_starts: list[int], start: int, end: int,
                      scale: float) -> torch.Tensor:
    """Rows [start, end) attending to every row of their own segment (an image, or a window
    of one). `qkv`: [3, rows, heads, head dim]; `segment_starts`: each segment's first row,
    then the row count. Returns [end - start, heads * head dim]."""
    first = bisect.bisect_right(segment_starts, start) - 1
    if qkv.is_cuda and qkv.dtype in (torch.float16, torch.bfloat16):
        return _varlen_segment_attention(qkv, segment_starts, first, start, end, scale)
    outputs = []
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


def advance_rows(state: Any, num_units: int, run_rows: Callable[[int, int], None]) -> int:
    """Run the next `num_units` row-passes of a sliced tower's `state` (its row, num_rows,
    pass_index, finished, and the double-buffered hidden / qkv of the pass) by calling
    run_rows(start, end) per run within a pass; returns those run (fewer only at the end)."""
    run = 0
    while run < num_units and not state.finished:
        count = min(num_units - run, state.num_rows - state.row)
        run_rows(state.row, state.row + count)
        run += count
        state.row += count
        if state.row == state.num_rows:
            state.pass_index += 1
            state.row = 0
            state.hidden, state.next_hidden = state.next_hidden, state.hidden
            state.qkv, state.next_qkv = state.next_qkv, state.qkv
    return run


def _varlen_segment_attention(qkv: torch.Tensor, segment_starts: list[int], first: int, start: int, end: int,
                              scale: float) -> torch.Tensor:
    """segment_attention as one variable-length flash attention call: queries are the rows
    [start, end), each segment's keys all of its rows (a slice may begin or end inside a
    segment). A window-attention block of a 1024x1024 image has ~86 segments: one launch
    instead of one attention call (and its Python) per window."""
    from torch.nn.attention.varlen import varlen_attn

    last = bisect.bisect_left(segment_starts, end) - 1  # the segment holding row end - 1
    bounds = segment_starts[first : last + 2]
    query_bounds = [start, *bounds[1:-1], end]
    key_start, key_end = bounds[0], bounds[-1]
    cu_q = _offsets_on(tuple(b - start for b in query_bounds), qkv.device)
    cu_k = _offsets_on(tuple(b - key_start for b in bounds), qkv.device)
    max_q = max(b - a for a, b in zip(query_bounds, query_bounds[1:]))
    max_k = max(b - a for a, b in zip(bounds, bounds[1:]))
    out = varlen_attn(qkv[0, start:end], qkv[1, key_start:key_end], qkv[2, key_start:key_end],
                      cu_q, cu_k, max_q, max_k, scale=scale)
    return out.reshape(end - start, -1)


@functools.lru_cache(maxsize=16)
def _offsets_on(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 offsets on the device, copied once: a tower's blocks share their segments."""
    return torch.tensor(offsets, dtype=torch.int32, device=device)
