"""Which CUDA graphs the engine captures at start, on CPU: every step over short contexts
(decode steps up to SHORT_CONTEXT keys, verify widths up to SHORT_VERIFY_CONTEXT) must find its
graph captured (no capture while serving), and no graph captured at start may be one that no
such step takes. Plans as on an H100 (132 multiprocessors), llama3-8b's 8 KV heads."""

from __future__ import annotations

import pytest
import torch

from kvserve.model_executor.cuda_graphs import batch_buckets, graph_plan, graphs_at_start
from kvserve.ops.attention import paged_attention

NUM_KV_HEADS = 8
CUDA = torch.device("cuda")  # only read for its multiprocessor count, patched below


@pytest.fixture(autouse=True)
def h100(monkeypatch) -> None:
    monkeypatch.setattr(paged_attention.device_info, "num_sms", lambda device, off_gpu=1: 132)


def steps_taken(max_batch: int, max_width: int, max_verify_batch: int, dtype: torch.dtype) -> set:
    """The graph key of every step over short contexts: decodes of 1..max_batch sequences,
    verify widths of 1..max_verify_batch, every context length."""
    buckets = batch_buckets(max_batch)
    keys = set()
    for batch in range(1, max_batch + 1):
        bucket = next(b for b in buckets if b >= batch)
        for width in range(1, (max_width if batch <= max_verify_batch else 1) + 1):
            context = paged_attention.SHORT_CONTEXT if width == 1 else paged_attention.SHORT_VERIFY_CONTEXT
            for seq_len in range(width, context + 1):
                keys.add((bucket, width, graph_plan(bucket, width, seq_len, NUM_KV_HEADS, dtype, CUDA)))
    return keys


@pytest.mark.parametrize(("max_batch", "max_width", "max_verify_batch", "dtype"), [
    (256, 1, 0, torch.bfloat16),   # no speculation
    (256, 5, 8, torch.bfloat16),   # k = 4, the default disable_by_batch_size
    (64, 9, 3, torch.float8_e4m3fn),  # a float8 cache; speculation up to 3 sequences (bucket 4)
    (6, 17, 6, torch.float32),     # the fp32 cache keeps the default tile
])
def test_graphs_at_start_are_those_short_contexts_take(max_batch, max_width, max_verify_batch, dtype) -> None:
    buckets = batch_buckets(max_batch)
    captured = graphs_at_start(buckets, max_width, max_verify_batch, NUM_KV_HEADS, dtype, CUDA)
    assert len(captured) == len(set(captured))
    assert set(captured) == steps_taken(max_batch, max_width, max_verify_batch, dtype)
    tokens = [bucket * width for bucket, width, _ in captured]
    assert tokens == sorted(tokens, reverse=True)  # the largest graphs first


def test_graphs_at_start_counts() -> None:
    """Exact counts on an H100 for llama3-8b: per bucket the unsplit plan, the short tile's
    2-32 splits at batches 1-2 (16 programs), the default tile's 2-8 KV splits (256 keys a
    split, 4 waves of programs: 2-4 at 16 sequences) at 4-16 sequences, and the wide-short tile
    from 64 sequences; verify widths add their own at buckets 1-8."""
    plain = graphs_at_start(batch_buckets(256), 1, 0, NUM_KV_HEADS, torch.bfloat16, CUDA)
    buckets = batch_buckets(256)
    assert len(buckets) == 35
    wide_short = sum(bucket >= paged_attention.WIDE_SHORT_BATCH for bucket in buckets)
    assert len(plain) == 35 + 2 * 5 + (3 + 3 + 2) + wide_short
    speculating = graphs_at_start(buckets, 5, 8, NUM_KV_HEADS, torch.bfloat16, CUDA)
    # Widths 2-5 up to 4096 keys at buckets 1 (unsplit + 2-32 short splits), 2 (unsplit + 2-16),
    # 4 (1-16 splits) and 8 (1-8 splits).
    assert len(speculating) - len(plain) == 4 * (6 + 5 + 5 + 4)
