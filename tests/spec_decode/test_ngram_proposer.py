"""Prompt lookup against hand-worked contexts."""

from __future__ import annotations

from kvserve.spec_decode.ngram_proposer import ngram_propose


def test_continuation_of_the_match():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 3, max_n=4, min_n=2) == [3, 4, 1]


def test_longest_n_wins_over_a_more_recent_shorter_match():
    # Suffix [7, 1, 2]: the 3-gram occurs once (followed by 5); the 2-gram [1, 2] occurs
    # later too (followed by 9), but the longer match is preferred.
    context = [7, 1, 2, 5, 0, 1, 2, 9, 7, 1, 2]
    assert ngram_propose(context, 1, max_n=3, min_n=2) == [5]
    assert ngram_propose(context, 1, max_n=2, min_n=2) == [9]


def test_most_recent_match_of_the_same_n():
    assert ngram_propose([1, 2, 3, 1, 2, 4, 1, 2], 1, max_n=2, min_n=2) == [4]


def test_short_continuation_and_no_match():
    assert ngram_propose([1, 2, 1, 2], 5, max_n=4, min_n=2) == [1, 2]
    assert ngram_propose([5, 6, 7, 8], 3, max_n=4, min_n=2) == []
    assert ngram_propose([5, 6], 3, max_n=4, min_n=2) == []
    # min_n = 1: a single repeated token is enough.
    assert ngram_propose([4, 8, 3, 4], 2, max_n=2, min_n=1) == [8, 3]
