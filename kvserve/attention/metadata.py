"""What an attention backend needs to know about one flattened batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvserve.ops.attention.batch import PagedBatch

if TYPE_CHECKING:
    from kvserve.ops.attention.paged_attention import DecodePlan


@dataclass
class AttentionMetadata(PagedBatch):
    """The batch's layout (PagedBatch: what the kernels read) and what backends decide
    about it."""

    # Split-KV count and key tile the Triton attention must use (a CUDA graph fixes its
    # grid); None: its choice.
    decode_plan: DecodePlan | None = None
    # Sequence index -> [q, q] bool mask among its query tokens, replacing the causal one
    # (speculative token trees; the context before the queries stays fully visible).
    tree_masks: dict[int, torch.Tensor] | None = None
    # [T] int64, the Triton kernel's form of the masks (query_visibility_bits), given where it
    # must be a fixed buffer (a CUDA graph's verify steps, trees or not); None: derived from
    # tree_masks where there are any.
    tree_bits: torch.Tensor | None = None
    # What a backend derives from this batch alike for every layer (slot indices, masks),
    # computed by the first layer that needs it and reused by the rest of the step.
    backend_plans: dict[str, Any] = field(default_factory=dict)
