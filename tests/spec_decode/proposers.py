"""Drafting stand-ins with known behaviour, swapped into an engine's speculator."""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.spec_decode.proposer import Draft, DraftContext


class ScriptedProposer:
    """Drafts from a known continuation of each prompt (the plain run's output).

    `num_correct` drafts are the true continuation, the rest are shifted by one token id
    so they are certainly wrong: None gives perfect drafts (every run fully accepted),
    0 gives drafts that are always rejected.
    """

    needs_hidden_states = False

    def __init__(
        self, continuations: dict[tuple[int, ...], list[int]], vocab_size: int,
        num_correct: int | None = None,
    ) -> None:
        self.continuations = continuations
        self.vocab_size = vocab_size
        self.num_correct = num_correct
        self.proposed: list[list[int]] = []  # every draft handed out, for assertions

    def propose(self, seqs: list[DraftContext], num_tokens: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, num_tokens):
            reference = self.continuations[tuple(seq.prompt_token_ids)]
            done = len(seq.output_token_ids)
            tokens = list(reference[done : done + k])
            correct = len(tokens) if self.num_correct is None else self.num_correct
            tokens = [t if i < correct else (t + 1) % self.vocab_size for i, t in enumerate(tokens)]
            self.proposed.append(tokens)
            drafts.append(Draft(tokens))
        return drafts

    def retain(self, seq_ids: Iterable[str]) -> None:
        pass
