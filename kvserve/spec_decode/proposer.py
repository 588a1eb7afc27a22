"""What every drafting method hands the engine."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.core.sequence import Sequence


@dataclass
class Draft:
    token_ids: list[int]
    # [len(token_ids), V] the distributions the drafts were sampled from; None: one-hot.
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        """Up to num_tokens[i] drafted tokens continuing seqs[i] (fewer, or none, is fine)."""

    def retain(self, seq_ids: Iterable[str]) -> None:
        """Drop any per-sequence state of sequences not in seq_ids (finished, preempted)."""
