"""The runner's per-sequence grammar state, and each step's token bitmask.

A sequence's matcher has consumed exactly the output tokens the runner holds for it: the
runner learns a step's accepted tokens with the next step (a verified run, stopped where
the sequence ended), and catches the matcher up then. A preempted sequence comes back with
the same tokens, so its matcher stays valid; a fork of n samples gets its own matcher,
replayed from its tokens. Drafts are tried on the matcher and rolled back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.structured_output.compiler import GrammarCompiler
from kvserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar


@dataclass
class ConstrainedRows:
    """A constrained sequence's rows of a step's logits: one, or 1 + k verifying k drafts
    (row j is reached only if drafts[:j] are accepted). `pending_token_ids`: tokens after
    the output that a step still in flight sampled (overlapped scheduling)."""

    seq_id: str
    params: StructuredOutputsParams
    output_token_ids: Sequence[int]
    first_row: int
    drafts: Sequence[int] = field(default_factory=list)
    pending_token_ids: Sequence[int] = ()


@dataclass
class _MatcherState:
    matcher: xgrammar.GrammarMatcher
    num_consumed: int = 0  # output tokens accepted so far


class GrammarMatchers:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._states: dict[str, _MatcherState] = {}
        self._bitmask: torch.Tensor | None = None  # host buffer, grown to the rows needed

    def prefetch(self, params: StructuredOutputsParams) -> None:
        self.compiler.prefetch(params)

    def forget(self, seq_ids: Sequence[str]) -> None:
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)

    def matcher(self, seq_id: str, params: StructuredOutputsParams, output_token_ids: Sequence[int],
                pending_token_ids: Sequence[int] = ()) -> xgrammar.GrammarMatcher:
        """The sequence's matcher, caught up with its output tokens and those after them
        that a step in flight sampled (the runner holds them with the next step)."""
        import xgrammar as xgr

        state = self._states.get(seq_id)
        if state is None:
            state = _MatcherState(xgr.GrammarMatcher(self.compiler.get(params)))
            self._states[seq_id] = state
        num_tokens = len(output_token_ids) + len(pending_token_ids)
        if state.num_consumed < num_tokens:
            known = output_token_ids[state.num_consumed:] if state.num_consumed < len(output_token_ids) else []
            pending = pending_token_ids[max(0, state.num_consumed - len(output_token_ids)):]
            for token_id in [*known, *pending]:
                # Every sampled token was allowed by the mask; one that is not (a token past
                # the grammar's end, with ignore_eos) leaves the matcher where it was.
                state.matcher.accept_token(token_id)
            state.num_consumed = num_tokens
        return state.matcher

    def mask_logits(self, logits: torch.Tensor, constrained: list[ConstrainedRows]) -> None:
        """Disallowed tokens' logits to -inf, in place, on the constrained rows only."""
        import xgrammar as xgr

        bitmask = self._bitmask_rows(logits.shape[0], pinned=logits.is_cuda)
        indices = []
        for rows in constrained:
            matcher = self.matcher(rows.seq_id, rows.params, rows.output_token_ids, rows.pending_token_ids)
            if matcher.is_terminated():
                # Its stop token is sampled: the sequence ends, and a row a step in flight
                # computed after it is dropped unread.
                continue
            num_accepted = 0
            for j in range(len(rows.drafts) + 1):
                matcher.fill_next_token_bitmask(bitmask, rows.first_row + j)
                indices.append(rows.first_row + j)
                # Rows after a draft the grammar refuses are never reached: that draft has
                # probability 0 on its row, so verification rejects it.
                if j == len(rows.drafts) or not matcher.accept_token(rows.drafts[j]):
                    break
                num_accepted += 1
            if num_accepted:
                matcher.rollback(num_accepted)
        if not indices:
            return
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size,
            indices=indices,
        )

    def allowed_drafts(self, seq_id: str, params: StructuredOutputsParams,
                       output_token_ids: Sequence[int], new_token_ids: Sequence[int],
                       drafts: Sequence[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows after the output tokens and
        this step's `new_token_ids` (not yet among them)."""
        matcher = self.matcher(seq_id, params, output_token_ids)
        num_accepted = 0
        allowed: list[int] = []
        for i, token_id in enumerate([*new_token_ids, *drafts]):
            if not matcher.accept_token(token_id):
                break
            num_accepted += 1
            if i >= len(new_token_ids):
                allowed.append(token_id)
        if num_accepted:
            matcher.rollback(num_accepted)
        return allowed

    def forced_tokens(self, seq_id: str, params: StructuredOutputsParams,
                      output_token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens spelling what the grammar forces after `output_token_ids`
        (which may run past the tokens the runner holds: this step's), xgrammar's jump-forward
        tokenization. The model may tokenize the same text otherwise: they are drafts."""
        state = self._states.get(seq_id)
        num_held = 0 if state is None else state.num_consumed
        matcher = self.matcher(seq_id, params, output_token_ids[:num_held])
        num_accepted = 0
        for token_id in output_token_ids[num_held:]:
            if not matcher.accept_token(token_id):
                break
            num_accepted += 1
        forced = []
        if num_accepted == len(output_token_ids) - num_held:
            forced = matcher.find_jump_forward_tokens()[:max_tokens]
        if num_accepted:
            matcher.rollback(num_accepted)
        return forced

    def _bitmask_rows(self, num_rows: int, pinned: bool) -> torch.Tensor:
        """Pinned for a GPU, so its copy does not hold up the host (the host refills it only
        after the step that read it has sampled)."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < num_rows or self._bitmask.is_pinned() != pinned:
            bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
            self._bitmask = bitmask.pin_memory() if pinned else bitmask
        return self._bitmask[:num_rows]
