"""Exact-distribution helpers for the speculative sampling tests."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy.stats import chisquare

P_VALUE_THRESHOLD = 1e-3


def reference_filter(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p by their definitions, one row at a time; renormalised.

    top-p keeps the smallest set of most likely tokens whose mass reaches top_p (of the
    top-k-renormalised distribution)."""
    out = torch.zeros_like(probs)
    for row in range(probs.shape[0]):
        order = sorted(range(probs.shape[1]), key=lambda t: -float(probs[row, t]))
        if top_k > 0:
            order = order[:top_k]
        total = sum(float(probs[row, t]) for t in order)
        kept, mass = [], 0.0
        for t in order:
            kept.append(t)
            mass += float(probs[row, t]) / total
            if mass >= top_p:
                break
        for t in kept:
            out[row, t] = probs[row, t]
    return out / out.sum(dim=-1, keepdim=True)


def chi_square_p_value(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Pearson chi-square of sample counts against exact probabilities; outcomes expected
    fewer than 5 times are pooled into one bin (outcomes of probability 0 must not occur)."""
    counts: dict[tuple[int, ...], int] = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    impossible = [s for s in counts if exact.get(s, 0.0) == 0.0]
    if impossible:
        return 0.0
    n = len(samples)
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for outcome, prob in exact.items():
        if prob * n < 5:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += prob * n
        else:
            observed.append(counts.get(outcome, 0))
            expected.append(prob * n)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    expected_arr = np.array(expected)
    expected_arr *= sum(observed) / expected_arr.sum()  # float rounding of the total
    return float(chisquare(observed, expected_arr).pvalue)


def all_sequences(vocab_size: int, length: int) -> list[tuple[int, ...]]:
    return list(itertools.product(range(vocab_size), repeat=length))
