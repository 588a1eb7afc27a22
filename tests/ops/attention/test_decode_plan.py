"""Which plan (KV splits, key tile) the Triton attention picks for a batch: exact counts."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.ops.attention.paged_attention import (
    SHORT_DECODE_TILE,
    WIDE_SHORT_BATCH,
    WIDE_SHORT_CONTEXT,
    DecodePlan,
    choose_decode_plan,
    choose_num_kv_splits,
    fuses_new_kv,
    short_tile_rows,
)

CPU = torch.device("cpu")


def _metadata(seq_lens: list[int], query_len: int = 1) -> AttentionMetadata:
    starts = [i * query_len for i in range(len(seq_lens) + 1)]
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens) * query_len, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(len(seq_lens), 1, dtype=torch.int32),
        block_size=16, max_query_len=query_len, max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize(("seq_lens", "splits"), [
    ([33], 2), ([64], 2), ([65], 4), ([128], 4), ([129], 8), ([192], 8), ([256], 8), ([257], 16),
    ([512], 16), ([513], 32), ([1024], 32), ([1025], 32), ([2048], 32), ([100, 700], 32), ([40, 12], 2),
])
def test_narrow_short_decodes_split_into_short_tiles(seq_lens, splits) -> None:
    """One or two sequences of llama3-8b's 8 KV heads (at most 16 programs), up to 2048 keys,
    a bf16 or float8 cache: the 32-key tile, the context in the power of two of slices at or
    above the tile count, up to 32."""
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        assert choose_decode_plan(_metadata(seq_lens), 8, dtype, CPU) == DecodePlan(splits, SHORT_DECODE_TILE)


@pytest.mark.parametrize(("seq_lens", "num_kv_heads", "dtype", "query_len"), [
    ([32], 8, torch.bfloat16, 1),  # a single tile: nothing to split
    ([2049], 8, torch.bfloat16, 1),  # past the short contexts
    ([4097], 8, torch.bfloat16, 5),  # past the verify steps' short contexts
    ([128, 128, 128], 8, torch.bfloat16, 1),  # 24 programs
    ([128], 32, torch.bfloat16, 1),  # 32 programs
    ([128], 8, torch.float32, 1),  # an fp32 cache
    ([128], 8, torch.bfloat16, 18),  # past verify widths
    ([128, 128, 128], 8, torch.bfloat16, 3),  # a verify step of 24 programs
])
def test_other_batches_keep_the_default_tile_and_split_rule(seq_lens, num_kv_heads, dtype, query_len) -> None:
    metadata = _metadata(seq_lens, query_len)
    plan = choose_decode_plan(metadata, num_kv_heads, dtype, CPU)
    assert plan == DecodePlan(choose_num_kv_splits(metadata, num_kv_heads, CPU))


@pytest.mark.parametrize(("seq_lens", "query_len", "splits"), [
    ([37], 5, 2), ([256], 5, 8), ([261], 9, 16), ([1024], 17, 16), ([100, 40], 2, 4), ([2048], 5, 16),
    ([2049], 5, 32), ([4096], 3, 32), ([2053, 100], 5, 16), ([4096, 100], 3, 16),
])
def test_narrow_short_verify_steps_split_into_short_tiles(seq_lens, query_len, splits) -> None:
    """Verify steps (up to 17 tokens a sequence) of at most 16 programs over at most 4096
    keys take the short-context plan as decodes do, up to 16 splits, 16- or 8-bit caches
    alike; one sequence (8 programs) past 2048 keys up to 32."""
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        metadata = _metadata(seq_lens, query_len)
        assert choose_decode_plan(metadata, 8, dtype, CPU) == DecodePlan(splits, SHORT_DECODE_TILE)


@pytest.mark.parametrize(("query_len", "group", "rows", "fused"), [
    (1, 4, 16, True), (1, 8, 16, True), (1, 32, 32, True),  # a decode token's head group
    (2, 4, 16, True), (4, 4, 16, True), (5, 4, 32, True), (9, 4, 64, True), (16, 4, 64, True),
    (17, 4, 64, False),  # 32 x 4 rows would not fit: 16 tokens a program, RoPE ahead
    (5, 7, 64, True), (9, 7, 64, False), (3, 1, 16, True),
])
def test_short_tile_holds_a_verify_step_whole_where_it_fits(query_len, group, rows, fused) -> None:
    """On the short tile a program's rows are its sequence's whole width (tokens x head group,
    each padded to a power of two) up to 64; only batches that fit take the fused RoPE."""
    group_pad = 1 << (group - 1).bit_length()
    assert short_tile_rows(query_len, group_pad) == rows
    metadata = _metadata([100], query_len)
    assert fuses_new_kv(metadata, SHORT_DECODE_TILE, torch.bfloat16, torch.bfloat16, group) == fused
    # Never over a float8 cache, nor on another tile.
    assert not fuses_new_kv(metadata, SHORT_DECODE_TILE, torch.bfloat16, torch.float8_e4m3fn, group)
    assert not fuses_new_kv(metadata, None, torch.bfloat16, torch.bfloat16, group)


def test_wide_short_decodes_take_the_short_tile_unsplit() -> None:
    """64 or more sequences over at most 384 keys and a 16-bit cache: the 32-key tile, one
    split; fewer sequences, a longer context, a float8 or fp32 cache or a verify step keep the
    default."""
    short = [WIDE_SHORT_CONTEXT - 3 * i for i in range(WIDE_SHORT_BATCH)]
    for dtype in (torch.bfloat16, torch.float16):
        assert choose_decode_plan(_metadata(short), 8, dtype, CPU) == DecodePlan(1, SHORT_DECODE_TILE)
        assert choose_decode_plan(_metadata(short + [9] * 100), 8, dtype, CPU) == DecodePlan(1, SHORT_DECODE_TILE)
    longer = short + [WIDE_SHORT_CONTEXT + 1]
    for seq_lens, dtype, query_len in [(short[1:], torch.bfloat16, 1), (longer, torch.bfloat16, 1),
                                       (short, torch.float8_e4m3fn, 1), (short, torch.float32, 1),
                                       (short, torch.bfloat16, 3)]:
        metadata = _metadata(seq_lens, query_len)
        assert choose_decode_plan(metadata, 8, dtype, CPU) == DecodePlan(choose_num_kv_splits(metadata, 8, CPU))


@pytest.mark.parametrize(("seq_lens", "splits", "plan"), [
    ([1025], 4, DecodePlan(32, SHORT_DECODE_TILE)),  # the short plan's context
    ([2049], 8, None), ([4096], 16, None), ([2049, 2049], 8, None), ([300] * 20, 1, None), ([100_000], 64, None),
])
def test_narrow_long_decodes_split_at_256_keys_a_split(monkeypatch, seq_lens, splits, plan) -> None:
    """On an H100's 132 multiprocessors, decode batches of few (sequence, KV head) programs
    split into slices of at least 256 keys, up to about 4 programs a multiprocessor and 64
    splits, the plan past the short contexts (None: the default tile over these splits); a
    batch of 160 programs fills the GPU unsplit."""
    from kvserve.ops.attention import paged_attention

    monkeypatch.setattr(paged_attention.device_info, "num_sms", lambda device, off_gpu=1: 132)
    metadata = _metadata(seq_lens)
    assert choose_num_kv_splits(metadata, 8, CPU) == splits
    assert choose_decode_plan(metadata, 8, torch.bfloat16, CPU) == (plan or DecodePlan(splits))
