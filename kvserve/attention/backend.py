"""The interface every attention implementation (torch reference, Triton, ...) meets."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvserve.attention import key_rotation
from kvserve.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    # Whether forward takes RoPE (`rotary`) at a saving (the Triton backend fuses it into its
    # decode attention kernel); if not, the model rotates q and k itself, in one launch.
    fuses_rotary: bool

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,  # RoPE's (cos, sin) [T, D / 2] fp32
    ) -> torch.Tensor:  # [T, H, D]
        """Write this step's key/value at metadata.slot_mapping, then attend causally
        over each sequence's whole context read from the paged cache. A float8 cache
        stores key / kv_scales[0] and value / kv_scales[1], saturated to its range.
        Given rotary, query and key are rotated first (RoPE, as apply_rotary rounds it);
        callers rotate themselves for a float8 cache, whose keys change basis after RoPE."""

    def to_key_basis(self, heads: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] queries or keys (or both, stacked along heads) in the basis a float8
        cache holds keys in (key_rotation.py): what the model hands forward after RoPE for a
        float8 cache, and what that cache's scales are measured in."""
        return key_rotation.to_key_basis(heads)
