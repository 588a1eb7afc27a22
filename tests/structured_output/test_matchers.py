"""The runner's bitmask on SmolLM2's vocabulary: a constrained row keeps exactly the tokens
that extend a valid output (checked against the tokenizer's own text), other rows are
untouched, draft rows are masked as of the drafts before them, and drafts are cut at the
first token the grammar refuses."""

from __future__ import annotations

import pytest
import torch

from kvserve.structured_output.matchers import ConstrainedRows, GrammarMatchers
from kvserve.structured_output.params import StructuredOutputsParams

CHOICES = ["yes", "no"]
YES_NO = StructuredOutputsParams(choice=CHOICES)


@pytest.fixture(scope="module")
def tokenizer(smollm2_loaded):
    return smollm2_loaded.tokenizer


@pytest.fixture
def matchers(smollm2_loaded, tokenizer) -> GrammarMatchers:
    config = smollm2_loaded.config
    return GrammarMatchers(tokenizer, config.vocab_size, config.eos_token_ids)


def _allowed(logits_row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits_row).nonzero().flatten().tolist())


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_mask_keeps_exactly_the_valid_continuations(matchers, tokenizer, smollm2_loaded):
    vocab_size = smollm2_loaded.config.vocab_size
    logits = torch.randn(3, vocab_size)
    original = logits.clone()
    matchers.mask_logits(logits, [ConstrainedRows("s", YES_NO, [], first_row=1)])
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    allowed = _allowed(logits[1])
    expected = {t for t in range(len(tokenizer)) if (text := tokenizer.decode([t]))
                and any(c.startswith(text) for c in CHOICES)}
    assert allowed == expected
    assert torch.equal(logits[1][list(allowed)], original[1][list(allowed)])


def test_matcher_follows_the_held_tokens_and_ends(matchers, tokenizer, smollm2_loaded):
    vocab_size = smollm2_loaded.config.vocab_size
    logits = torch.zeros(1, vocab_size)
    matchers.mask_logits(logits, [ConstrainedRows("s", YES_NO, _ids(tokenizer, "yes"), 0)])
    # After a whole choice only the end of the sequence is allowed.
    assert _allowed(logits[0]) == set(smollm2_loaded.config.eos_token_ids) & set(range(vocab_size))


def test_draft_rows_are_masked_as_of_the_drafts_before_them(matchers, tokenizer, smollm2_loaded):
    regex = StructuredOutputsParams(regex="[0-9]{3}")
    digit = _ids(tokenizer, "7")
    assert len(digit) == 1
    logits = torch.zeros(4, smollm2_loaded.config.vocab_size)
    matchers.mask_logits(logits, [ConstrainedRows("s", regex, [], 0, drafts=digit * 3)])
    eos = set(smollm2_loaded.config.eos_token_ids)
    assert digit[0] in _allowed(logits[0]) and not eos & _allowed(logits[0])
    assert _allowed(logits[3]) == eos  # after three digits: the end
    # The drafts were tried and rolled back: the first row's state is unchanged.
    again = torch.zeros(1, logits.shape[1])
    matchers.mask_logits(again, [ConstrainedRows("s", regex, [], 0)])
    assert _allowed(again[0]) == _allowed(logits[0])


def test_drafts_cut_at_the_first_refused_token(matchers, tokenizer):
    regex = StructuredOutputsParams(regex="[0-9]{3}")
    one, letter = _ids(tokenizer, "1"), _ids(tokenizer, "x")
    assert matchers.allowed_drafts("s", regex, [], one, one + letter + one) == one
    assert matchers.allowed_drafts("s", regex, [], one, letter) == []
    assert matchers.allowed_drafts("s", regex, one, one, one + one) == one  # 3 digits, then end


def test_forced_tokens_spell_what_the_grammar_forces_and_leave_the_state(matchers, tokenizer, smollm2_loaded):
    """Jump-forward drafts: the text the regex forces next, from the held tokens or past
    them (this step's new tokens), with the matcher left where the held tokens put it."""
    vocab_size = smollm2_loaded.config.vocab_size
    forced = StructuredOutputsParams(regex="order_number_[0-9]{2}_confirmed")

    def mask(held: list[int]) -> torch.Tensor:
        logits = torch.zeros(1, vocab_size)
        matchers.mask_logits(logits, [ConstrainedRows("s", forced, held, 0)])
        return logits

    def jump(output_token_ids: list[int], forced_text: str, max_tokens: int = 16) -> list[int]:
        tokens = matchers.forced_tokens("s", forced, output_token_ids, max_tokens)
        # xgrammar may leave out a last token that a longer token extends: a prefix.
        assert tokens and forced_text.startswith(text := tokenizer.decode(tokens)), tokens
        assert len(text) >= len(forced_text) - 2, text
        return tokens

    before = mask([])
    jump([], "order_number_")
    jump(_ids(tokenizer, "order"), "_number_")  # past the held tokens
    assert len(matchers.forced_tokens("s", forced, [], 2)) == 2
    assert torch.equal(mask([]), before)  # still at the start
    held = _ids(tokenizer, "order_number_4")
    mask(held)
    assert matchers.forced_tokens("s", forced, held, 16) == []  # a digit is a choice
    jump(held + _ids(tokenizer, "2"), "_confirmed")
