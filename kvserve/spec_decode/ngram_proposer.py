"""Prompt lookup: the draft is what followed the latest earlier occurrence of the context's
suffix n-gram. Free to compute and strong on "repeat / edit this text" requests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvserve.spec_decode.proposer import Draft, DraftContext


def ngram_propose(
    token_ids: Sequence[int], num_tokens: int, max_n: int, min_n: int
) -> list[int]:
    """Up to `num_tokens` drafted ids (possibly none) for the context `token_ids`.

    n runs from max_n down to min_n; the first n with a match wins, and among its matches
    the most recent one (nearest context is the best predictor of what comes next).
    """
    if num_tokens < 1 or len(token_ids) <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # Windows that start early enough to have at least one token after them.
        windows = sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start : start + num_tokens].tolist()
    return []


class NgramProposer:
    needs_hidden_states = False

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, seqs: list[DraftContext], num_tokens: list[int]) -> list[Draft]:
        return [
            Draft(ngram_propose(seq.all_token_ids, k, self.max_n, self.min_n))
            for seq, k in zip(seqs, num_tokens)
        ]

    def retain(self, seq_ids: Iterable[str]) -> None:
        """Stateless: the lookup reads the sequence's own tokens every step."""
