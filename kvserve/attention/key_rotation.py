"""Keys of a float8 KV cache live in a rotated basis, and queries are rotated to match.

For an orthonormal R, (qR)·(kR) = q·k, so attention is unchanged in exact arithmetic. What
changes is where e4m3's rounding lands: its error is relative to each element, so without a
rotation it sits on the few large key channels (RoPE's outliers) that also carry most of
q·k; a Hadamard rotation spreads every key over all channels first, so the rounding no
longer falls on the channels that decide the scores (an e4m3 cache with rotated keys costs
SmolLM2 +0.77% perplexity: BENCHMARKS.md, "Quality"). Values are stored as they are:
rotating them measured no better.

Attention backends own the basis (AttentionBackend.to_key_basis): the model asks them for
queries and keys after RoPE, the model runner for keys when it measures a cache's scales."""

from __future__ import annotations

import functools

import torch

# Seed of the random orthogonal basis used where head_dim is not a power of two.
_RANDOM_BASIS_SEED = 0


@functools.cache
def key_rotation(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[head_dim, head_dim] orthonormal: the Sylvester Hadamard matrix over sqrt(head_dim)
    for powers of two, else a fixed random orthogonal matrix."""
    if head_dim & (head_dim - 1) == 0:
        basis = torch.ones(1, 1, dtype=torch.float64)
        while basis.shape[0] < head_dim:
            basis = torch.cat([torch.cat([basis, basis], 1), torch.cat([basis, -basis], 1)])
        basis = basis / head_dim**0.5
    else:
        generator = torch.Generator().manual_seed(_RANDOM_BASIS_SEED)
        gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        basis, _ = torch.linalg.qr(gaussian)
    return basis.to(device=device, dtype=dtype)


def to_key_basis(heads: torch.Tensor) -> torch.Tensor:
    """[T, heads, head_dim] queries or keys (or both, stacked along heads) in the float8
    cache's key basis."""
    return heads @ key_rotation(heads.shape[-1], heads.device, heads.dtype)
