"""TorchReferenceBackend against dense causal attention on random inputs."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import torch_ref

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_ref import TorchReferenceBackend

HEAD_DIM = 64
BLOCK_SIZE = 5  # lengths below are deliberately not multiples of it
NUM_BLOCKS = 40


@pytest.fixture(params=[True, False], ids=["kernel", "torch"])
def decode_kernel(request) -> bool:
    """Decodes through kvserve's CPU attention kernel or through the gathered copy and SDPA."""
    if request.param:
        assert torch_ref.attends_in_place(torch.zeros(1), torch.zeros(1)), "the CPU kernels did not build"
    return request.param


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, H, D] for the last q_len of the L context positions; k, v: [L, KVH, D]."""
    q_len, num_heads, _ = q.shape
    context_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(context_len - q_len, context_len)[:, None]
    scores = scores.masked_fill(torch.arange(context_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("max_gather", [None, 40])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_mixed_batch_matches_dense(num_heads: int, num_kv_heads: int, max_gather, monkeypatch, decode_kernel) -> None:
    if max_gather is not None:  # force the decodes into several gather groups
        monkeypatch.setattr(torch_ref, "MAX_DECODE_GATHER_POSITIONS", max_gather)
    torch.manual_seed(0)
    # (context length, new tokens): decodes, short spans attended as decode rows (verify
    # steps, small chunks) and a long chunk attended as a prefill, some with a cached prefix.
    seqs = [(9, 1), (13, 13), (22, 7), (17, 1), (1, 1), (31, 1), (6, 4), (40, 21)]
    free_blocks = torch.randperm(NUM_BLOCKS).tolist()
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)  # garbage elsewhere
    max_blocks = max(-(-length // BLOCK_SIZE) for length, _ in seqs)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    queries, keys, values, slot_mapping, expected = [], [], [], [], []
    scale = HEAD_DIM**-0.5
    for i, (context_len, q_len) in enumerate(seqs):
        blocks = [free_blocks.pop() for _ in range(-(-context_len // BLOCK_SIZE))]
        block_tables[i, : len(blocks)] = torch.tensor(blocks)
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context_len)]
        k = torch.randn(context_len, num_kv_heads, HEAD_DIM)
        v = torch.randn(context_len, num_kv_heads, HEAD_DIM)
        q = torch.randn(q_len, num_heads, HEAD_DIM)
        prefix = context_len - q_len
        flat = kv_cache.view(2, -1, num_kv_heads, HEAD_DIM)
        flat[0, slots[:prefix]], flat[1, slots[:prefix]] = k[:prefix], v[:prefix]
        queries.append(q)
        keys.append(k[prefix:])
        values.append(v[prefix:])
        slot_mapping += slots[prefix:]
        expected.append(dense_reference(q, k, v, scale))
    q_lens = [q_len for _, q_len in seqs]
    starts = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    seq_lens = [length for length, _ in seqs]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        block_size=BLOCK_SIZE,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    key, value = torch.cat(keys), torch.cat(values)
    out = TorchReferenceBackend(decode_kernel=decode_kernel).forward(
        torch.cat(queries), key, value, kv_cache, metadata, scale)

    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)
    flat = kv_cache.view(2, -1, num_kv_heads, HEAD_DIM)
    assert torch.equal(flat[0, metadata.slot_mapping], key)
    assert torch.equal(flat[1, metadata.slot_mapping], value)


@pytest.mark.parametrize("sliding_window", [None, 7])
def test_decode_context_matches_the_paged_decode(sliding_window, decode_kernel) -> None:
    """The compiled decode's attention (cached context read, the new key/value appended rather
    than written), through the CPU kernel or gathered for SDPA, against the backend's decode
    path on the same step with the gathered copy and SDPA."""
    torch.manual_seed(1)
    num_heads, num_kv_heads = 6, 2
    seq_lens = [9, 1, 31, 17, 2, 10]  # uneven: padding and, with the window, cut contexts
    free_blocks = torch.randperm(NUM_BLOCKS).tolist()
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    max_blocks = max(-(-length // BLOCK_SIZE) for length in seq_lens)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slot_mapping = []
    for i, length in enumerate(seq_lens):
        blocks = [free_blocks.pop() for _ in range(-(-length // BLOCK_SIZE))]
        block_tables[i, : len(blocks)] = torch.tensor(blocks)
        slot_mapping.append(blocks[(length - 1) // BLOCK_SIZE] * BLOCK_SIZE + (length - 1) % BLOCK_SIZE)
    starts = list(range(len(seq_lens) + 1))
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        block_size=BLOCK_SIZE, max_query_len=1, max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )
    query = torch.randn(len(seq_lens), num_heads, HEAD_DIM)
    key = torch.randn(len(seq_lens), num_kv_heads, HEAD_DIM)
    value = torch.randn(len(seq_lens), num_kv_heads, HEAD_DIM)
    scale = HEAD_DIM**-0.5

    context_cache = kv_cache.clone()
    context = torch_ref.decode_context(metadata, sliding_window)
    backend = TorchReferenceBackend(sliding_window, decode_kernel=decode_kernel)
    out = backend.forward(query, key, value, context_cache, context, scale)
    assert torch.equal(context_cache, kv_cache)  # nothing written: the caller writes new_kv
    assert len(context.new_kv) == 1 and context.new_kv[0][0] is key and context.new_kv[0][1] is value
    gathered = TorchReferenceBackend(sliding_window, decode_kernel=False)
    expected = gathered.forward(query, key, value, kv_cache, metadata, scale)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-6)


def test_verify_steps_attend_as_decode_rows() -> None:
    """A verify step's 1 + k rows take the decode path (on an fp32 CPU cache, the in-place
    kernel), each over the context up to itself, not the prefill path's gathered copy: what
    keeps a verify step as cheap as a decode batch of as many rows."""
    num_queries, seq_len = 5, 23
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(seq_len - num_queries, seq_len), query_start_loc=torch.tensor([0, num_queries]),
        seq_lens=torch.tensor([seq_len]), block_tables=torch.arange(5, dtype=torch.int32)[None],
        block_size=BLOCK_SIZE, max_query_len=num_queries, max_seq_len=seq_len,
        query_start_loc_cpu=[0, num_queries], seq_lens_cpu=[seq_len],
    )
    plan = torch_ref._plan(metadata, None)
    assert plan.prefill_chunks == []
    [group] = plan.decode_groups
    assert group.token_index.tolist() == list(range(num_queries))
    assert group.valid.sum(dim=1).tolist() == list(range(seq_len - num_queries + 1, seq_len + 1))
