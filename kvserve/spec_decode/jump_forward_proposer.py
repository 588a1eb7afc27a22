"""Jump-forward: where a request's grammar forces the next text (a JSON schema's fixed keys,
the punctuation between them), its tokens are the draft, so one verify step emits a run
that plain decoding spends a step a token on. Verification keeps the output exactly what
decoding without it gives: the draft is xgrammar's tokenization of the forced text, and
where the model would split that text otherwise, the model's token wins."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvserve.spec_decode.proposer import Draft, DraftContext
from kvserve.structured_output.matchers import GrammarMatchers


class JumpForwardProposer:
    needs_hidden_states = False

    def __init__(self, grammars: Callable[[], GrammarMatchers]) -> None:
        """`grammars`: the runner's matchers (made by the first constrained request)."""
        self._grammars = grammars

    def propose(self, seqs: list[DraftContext], num_tokens: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, num_tokens):
            structured = seq.params.structured_outputs
            forced = [] if structured is None else self._grammars().forced_tokens(
                seq.seq_id, structured, seq.output_token_ids, k)
            drafts.append(Draft(forced))
        return drafts

    def retain(self, seq_ids: Iterable[str]) -> None:
        """Stateless: the matchers belong to the runner, which forgets finished sequences."""
