"""The EAGLE drafter's paged KV cache: attention read through its block tables equals dense
attention over each sequence's keys (rows across block boundaries, after truncations and
rewrites), blocks go back to the pool with their sequences, and a sequence that finds the
pool full skips drafting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve import SamplingParams
from kvserve.attention import torch_ref
from kvserve.attention.torch_ref import TorchReferenceBackend
from kvserve.spec_decode.eagle import EagleHead, EagleProposer, paged_draft_cache, top_ids
from kvserve.spec_decode.paged_draft_cache import PagedDraftCache
from kvserve.spec_decode.proposer import DraftContext

BLOCK_SIZE = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16  # 16: the Triton kernels' smallest head


def _dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [m, H, D]: the last m of a sequence's positions, each attending the positions up to
    itself of keys/values [length, KVH, D]; [m, H x D]."""
    m, length = q.shape[0], keys.shape[0]
    positions = torch.arange(length, device=q.device)
    mask = positions[None, :] <= positions[length - m :, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(m, -1)


# Per round: truncations (rejected drafts dropped), then new rows per sequence. Lengths
# cross block boundaries; 20 rows take the backend's prefill path, a few its decode rows.
ROUNDS = [
    ({}, {"a": 20, "b": 3, "c": 7}),
    ({"a": 13, "b": 1}, {"a": 5, "b": 6, "c": 1}),
    ({"a": 17, "b": 4, "c": 2}, {"a": 1, "b": 1, "c": 1}),
    ({"c": 0}, {"a": 2, "b": 9, "c": 3}),
]


def _check_against_dense(cache: PagedDraftCache, device: torch.device) -> None:
    torch.manual_seed(0)
    keys: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for truncations, counts in ROUNDS:
        for seq_id, length in truncations.items():
            cache.truncate(seq_id, length)
            keys[seq_id], values[seq_id] = keys[seq_id][:length], values[seq_id][:length]
        seq_ids = list(counts)
        for seq_id in seq_ids:
            assert cache.reserve(seq_id, counts[seq_id])
        q = {s: torch.randn(counts[s], HEADS, HEAD_DIM, device=device) for s in seq_ids}
        k = {s: torch.randn(counts[s], KV_HEADS, HEAD_DIM, device=device) for s in seq_ids}
        v = {s: torch.randn(counts[s], KV_HEADS, HEAD_DIM, device=device) for s in seq_ids}
        rows = cache.extend(seq_ids, [counts[s] for s in seq_ids])
        out = rows.attend(*(torch.cat([x[s] for s in seq_ids]) for x in (q, k, v)))
        expected = []
        for seq_id in seq_ids:
            empty = torch.empty(0, KV_HEADS, HEAD_DIM, device=device)
            keys[seq_id] = torch.cat([keys.get(seq_id, empty), k[seq_id]])
            values[seq_id] = torch.cat([values.get(seq_id, empty), v[seq_id]])
            assert cache.length(seq_id) == keys[seq_id].shape[0]
            expected.append(_dense_attention(q[seq_id], keys[seq_id], values[seq_id]))
        torch.testing.assert_close(out, torch.cat(expected), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("decode_kernel", [True, False], ids=["kernel", "torch"])
def test_paged_attention_equals_dense_attention(decode_kernel) -> None:
    """Through kvserve's CPU decode kernel or the gathered copy and SDPA."""
    if decode_kernel:
        assert torch_ref.attends_in_place(torch.zeros(1), torch.zeros(1)), "the CPU kernels did not build"
    cache = PagedDraftCache(24, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    cache.backend = TorchReferenceBackend(decode_kernel=decode_kernel)
    _check_against_dense(cache, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_paged_attention_equals_dense_attention_with_triton() -> None:
    device = torch.device("cuda")
    cache = PagedDraftCache(24, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, device)
    assert type(cache.backend).__name__ == "TritonAttentionBackend"
    _check_against_dense(cache, device)


def test_blocks_are_taken_on_demand_and_given_back_by_retain() -> None:
    cache = PagedDraftCache(10, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    assert cache.reserve("a", 9) and cache.num_free_blocks == 7  # 3 blocks
    cache.extend(["a"], [9])
    assert cache.reserve("b", 4) and cache.num_free_blocks == 6
    cache.truncate("a", 2)  # a shorter length keeps the blocks
    assert cache.reserve("a", 10) and cache.num_free_blocks == 6  # positions 2..11: its 3 blocks
    assert cache.reserve("a", 11) and cache.num_free_blocks == 5  # 2..12: a fourth
    assert not cache.reserve("c", 6 * BLOCK_SIZE) and cache.num_free_blocks == 5  # too few: none taken
    with pytest.raises(RuntimeError, match="c writes position 0, past its 0 reserved blocks"):
        cache.extend(["c"], [1])
    cache.retain(["b", "c"])
    assert cache.num_free_blocks == 9 and cache.length("a") == 0
    cache.retain([])
    assert cache.num_free_blocks == 10


HIDDEN, VOCAB = 64, 24


def _proposer(num_blocks: int) -> EagleProposer:
    torch.manual_seed(0)
    head = EagleHead(HIDDEN, HEADS, KV_HEADS, 48, 10000.0, 1e-6, fc_bias=True).eval()
    embed, lm_head = nn.Embedding(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    return EagleProposer(head, embed, lambda estimate, n: top_ids(estimate @ lm_head.T, n),
                         paged_draft_cache(head, num_blocks, BLOCK_SIZE))


def test_a_full_pool_makes_a_sequence_skip_drafting() -> None:
    """A sequence that finds too few free blocks for its pairs and draft steps drafts nothing
    this step (and takes no block); it drafts once retain gives blocks back."""
    proposer, unbounded = _proposer(num_blocks=5), _proposer(num_blocks=64)
    tokens = {"long": torch.randint(0, VOCAB, (15,)).tolist(), "short": torch.randint(0, VOCAB, (9,)).tolist()}
    features = torch.randn(15, HIDDEN)
    for drafter in (proposer, unbounded):
        for seq_id, ids in tokens.items():
            drafter.observe(seq_id, 0, features[: len(ids) - 1])
    contexts = [DraftContext(seq_id, ids, 4, SamplingParams(), 64, None) for seq_id, ids in tokens.items()]
    # long: 14 pairs and 2 draft steps, 4 blocks; short: 8 + 2 positions, 3 blocks (1 left).
    long_draft, short_draft = proposer.propose(contexts, [3, 3])
    assert len(long_draft.token_ids) == 3 and short_draft.token_ids == []
    assert proposer.cache.num_free_blocks == 1
    proposer.retain(["short"])  # long finished
    assert proposer.cache.num_free_blocks == 5
    [short_draft] = proposer.propose(contexts[1:], [3])
    assert proposer.cache.num_free_blocks == 2
    assert short_draft.token_ids == unbounded.propose(contexts[1:], [3])[0].token_ids
