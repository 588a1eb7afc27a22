"""What every drafting method reads of a sequence and hands back."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.sampling_params import SamplingParams


@dataclass
class DraftContext:
    """A sequence about to draft: every token it holds, the newest sampled one included."""

    seq_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator | None
    # [H] the target's last-layer hidden state at the row that predicted the newest token
    # (what draft heads read); None unless the proposer asks for it (needs_hidden_states).
    hidden_state: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]


@dataclass
class Draft:
    token_ids: list[int]
    # [len(token_ids), V] the distributions the drafts were sampled from; None: one-hot.
    probs: torch.Tensor | None = None
    # A token tree: each draft's parent (-1: the newest token), in topological order; None:
    # a chain. Trees carry one-hot (deterministic) candidates.
    parents: list[int] | None = None


class Proposer(Protocol):
    # Whether propose() reads DraftContext.hidden_state (draft heads: Medusa).
    needs_hidden_states: bool
    def propose(self, seqs: list[DraftContext], num_tokens: list[int]) -> list[Draft]:
        """Up to num_tokens[i] drafted tokens continuing seqs[i] (fewer, or none, is fine)."""

    def retain(self, seq_ids: Iterable[str]) -> None:
        """Drop any per-sequence state of sequences not in seq_ids (finished, preempted)."""
