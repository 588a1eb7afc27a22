"""kvserve's CPU decode attention kernel against dense attention in float64."""

from __future__ import annotations

import pytest
import torch

from kvserve.ops.cpu import decode_attention_op


@pytest.fixture(scope="module")
def decode_attention():
    op = decode_attention_op()
    assert op is not None, "the CPU kernels did not build"
    return op


def dense(query, keys, values, seen, scale):
    """query [H, D] against keys/values [L, KVH, D] at the positions `seen` [L] (float64)."""
    group = query.shape[0] // keys.shape[1]
    k = keys[seen].double().repeat_interleave(group, dim=1)
    v = values[seen].double().repeat_interleave(group, dim=1)
    if k.shape[0] == 0:
        return torch.zeros_like(query)
    probs = (torch.einsum("hd,lhd->hl", query.double(), k) * scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", probs, v).float()


def random_step(batch, context, heads, kv_heads, dim, block_size=4, num_blocks=128, seed=0):
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=generator) * 2
    blocks = torch.randperm(num_blocks, generator=generator)[: batch * -(-context // block_size)]
    slots = (blocks.view(batch, -1, 1) * block_size + torch.arange(block_size)).view(batch, -1)[:, :context]
    valid = torch.rand(batch, context, generator=generator) < 0.8  # masked positions in between
    query = torch.randn(batch, heads, dim, generator=generator)
    key = torch.randn(batch, kv_heads, dim, generator=generator)
    value = torch.randn(batch, kv_heads, dim, generator=generator)
    return cache, slots.contiguous(), valid, query, key, value


# head_dim 40 takes the scalar path; contexts around multiples of the kernel's 8-key steps.
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 40), (8, 2, 16)])
@pytest.mark.parametrize("context", [1, 7, 8, 9, 16, 130])
@pytest.mark.parametrize("with_new", [True, False])
def test_matches_dense(decode_attention, heads, kv_heads, dim, context, with_new) -> None:
    batch, scale = 3, dim**-0.5
    cache, slots, valid, query, key, value = random_step(batch, context, heads, kv_heads, dim, seed=context)
    valid[0, 0] = True  # every row sees at least one position
    out = decode_attention(query, cache, slots, valid, key if with_new else None, value if with_new else None, scale)
    flat = cache.view(2, -1, kv_heads, dim)
    for b in range(batch):
        keys, values, seen = flat[0, slots[b]], flat[1, slots[b]], valid[b]
        if with_new:
            keys, values = torch.cat([keys, key[b : b + 1]]), torch.cat([values, value[b : b + 1]])
            seen = torch.cat([seen, torch.tensor([True])])
        torch.testing.assert_close(out[b], dense(query[b], keys, values, seen, scale), atol=2e-6, rtol=2e-6)


def test_large_scores_and_strided_query(decode_attention) -> None:
    """Scores far from zero (the softmax subtracts the largest) and a query that is a view of
    the fused q/k projection, as the model passes it."""
    cache, slots, valid, query, key, value = random_step(2, 37, 6, 2, 64, seed=5)
    fused = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(5)) * 30
    query = fused[:, :6]
    out = decode_attention(query, cache, slots, valid, key, value, 0.125)
    flat = cache.view(2, -1, 2, 64)
    for b in range(2):
        keys, values = torch.cat([flat[0, slots[b]], key[b : b + 1]]), torch.cat([flat[1, slots[b]], value[b : b + 1]])
        seen = torch.cat([valid[b], torch.tensor([True])])
        # Scores reach a few hundred: their fp32 rounding (~1e-5 relative) moves the softmax by
        # up to ~4e-5 over 300 random queries, so the bound is 1e-4, not the 2e-6 of unit scores.
        torch.testing.assert_close(out[b], dense(query[b], keys, values, seen, 0.125), atol=1e-4, rtol=1e-4)


def test_nothing_seen_gives_zeros(decode_attention) -> None:
    cache, slots, valid, query, _, _ = random_step(2, 5, 4, 2, 16)
    valid[1] = False
    out = decode_attention(query, cache, slots, valid, None, None, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all()


def test_bad_inputs_are_refused(decode_attention) -> None:
    cache, slots, valid, query, key, value = random_step(1, 8, 4, 2, 16)
    with pytest.raises(RuntimeError, match="query must be fp32"):
        decode_attention(query.bfloat16(), cache, slots, valid, key, value, 0.25)
    with pytest.raises(RuntimeError, match="kv_cache must be a contiguous fp32"):
        decode_attention(query, cache.bfloat16(), slots, valid, key, value, 0.25)
    with pytest.raises(RuntimeError, match="3 query heads"):
        decode_attention(query[:, :3], cache, slots, valid, key, value, 0.25)
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode_attention(query, cache, slots + 10**6, valid, key, value, 0.25)
    with pytest.raises(RuntimeError, match="key and value come together"):
        decode_attention(query, cache, slots, valid, key, None, 0.25)
