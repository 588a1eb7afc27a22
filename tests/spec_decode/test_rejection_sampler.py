"""The rejection sampler leaves the target distribution exactly unchanged.

A three-token "model" with known conditional tables (after top-k/top-p) is decoded
speculatively with a deliberately bad draft, 30,000 sequences in one batch per round;
the joint distribution of the three tokens must match the exact one by chi-square. The
same test run with a verifier whose acceptance is biased must fail it.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.spec_decode import rejection_sampler
from kvserve.spec_decode.rejection_sampler import DraftVerification, rejection_sample
from tests.spec_decode.distribution import (
    P_VALUE_THRESHOLD, all_sequences, chi_square_p_value, reference_filter,
)

VOCAB = 5
LENGTH = 3
NUM_SAMPLES = 30_000


class TableModel:
    """p(token | prefix) for every prefix shorter than LENGTH, from seeded random logits."""

    def __init__(self, seed: int, sharpness: float, top_k: int = -1, top_p: float = 1.0):
        generator = torch.Generator().manual_seed(seed)
        self.tables: dict[tuple[int, ...], torch.Tensor] = {}
        for length in range(LENGTH + 1):
            for prefix in all_sequences(VOCAB, length):
                logits = sharpness * torch.randn(1, VOCAB, generator=generator)
                probs = reference_filter(torch.softmax(logits, dim=-1), top_k, top_p)
                self.tables[prefix] = probs[0]

    def joint(self) -> dict[tuple[int, ...], float]:
        exact = {}
        for seq in all_sequences(VOCAB, LENGTH):
            prob = 1.0
            for i, token in enumerate(seq):
                prob *= float(self.tables[seq[:i]][token])
            exact[seq] = prob
        return exact


def speculative_samples(target: TableModel, draft: TableModel | None, seed: int) -> list[tuple[int, ...]]:
    """Decode NUM_SAMPLES sequences: each round drafts the missing tokens (from `draft`'s
    tables, or always token 0 as a one-hot n-gram-like draft) and verifies them."""
    generator = torch.Generator().manual_seed(seed)
    prefixes: list[tuple[int, ...]] = [()] * NUM_SAMPLES
    while any(len(p) < LENGTH for p in prefixes):
        todo = [i for i, p in enumerate(prefixes) if len(p) < LENGTH]
        verifications, rows = [], []
        for i in todo:
            context = prefixes[i]
            drafts, draft_rows = [], []
            for _ in range(LENGTH - len(context)):
                if draft is None:
                    token = 0
                else:
                    q = draft.tables[context + tuple(drafts)]
                    token = int(torch.multinomial(q, 1, generator=generator))
                    draft_rows.append(q)
                drafts.append(token)
            for j in range(len(drafts) + 1):
                rows.append(target.tables[context + tuple(drafts[:j])])
            verifications.append(DraftVerification(
                drafts, torch.stack(draft_rows) if draft_rows else None, None))
        runs = rejection_sample(torch.stack(rows), verifications)
        for i, run in zip(todo, runs):
            prefixes[i] = (prefixes[i] + tuple(run.token_ids))[:LENGTH]
    return prefixes


@pytest.mark.parametrize(
    ("top_k", "top_p", "one_hot_draft"),
    [(-1, 1.0, False), (3, 0.8, False), (-1, 1.0, True)],
    ids=["temperature-1", "top-k-top-p", "one-hot-draft"],
)
def test_matches_the_exact_target_distribution(top_k, top_p, one_hot_draft):
    torch.manual_seed(0)
    target = TableModel(seed=1, sharpness=1.0, top_k=top_k, top_p=top_p)
    # A peaky draft from other random logits: often wrong, so rejections are frequent.
    draft = None if one_hot_draft else TableModel(seed=2, sharpness=2.0)
    samples = speculative_samples(target, draft, seed=3)
    assert chi_square_p_value(samples, target.joint()) > P_VALUE_THRESHOLD


def test_biased_acceptance_is_caught(monkeypatch):
    """The same test fails for a verifier that accepts drafts 1.5x too readily."""
    monkeypatch.setattr(
        rejection_sampler, "accept_mask", lambda p, q, u: u * q < 1.5 * p
    )
    torch.manual_seed(0)
    target = TableModel(seed=1, sharpness=1.0)
    samples = speculative_samples(target, TableModel(seed=2, sharpness=2.0), seed=3)
    assert chi_square_p_value(samples, target.joint()) < P_VALUE_THRESHOLD


def test_greedy_accepts_the_argmax_prefix():
    # One-hot target rows (greedy): drafts [2, 4, 1] against argmaxes [2, 4, 3, 0].
    target = torch.nn.functional.one_hot(torch.tensor([2, 4, 3, 0]), VOCAB).float()
    runs = rejection_sample(target, [DraftVerification([2, 4, 1], None, None)])
    assert runs[0].token_ids == [2, 4, 3] and runs[0].num_accepted == 2
    runs = rejection_sample(target[:3], [DraftVerification([2, 4], None, None)])
    assert runs[0].token_ids == [2, 4, 3] and runs[0].num_accepted == 2


def test_seeded_sequences_are_reproducible_and_batch_independent():
    target = torch.softmax(torch.randn(3, VOCAB), dim=-1)
    other = torch.softmax(torch.randn(2, VOCAB), dim=-1)

    def run(with_other: bool) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        seqs = [DraftVerification([1, 2], None, gen)]
        probs = target
        if with_other:
            seqs.append(DraftVerification([0], None, None))
            probs = torch.cat([target, other])
        return [rejection_sample(probs, seqs)[0].token_ids for _ in range(5)]

    assert run(False) == run(True)
