"""The engine's side of speculative decoding: who drafts this step, and verifying drafts
against the target's logits of one forward pass."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvserve.core.sequence import Sequence, SequenceStatus
from kvserve.sample.sampler import SamplingRow, final_probs, gather_logprobs
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.proposer import Proposer
from kvserve.spec_decode.rejection_sampler import DraftVerification, VerifiedRun, rejection_sample
from kvserve.spec_decode.stats import SpecDecodeStats


@dataclass
class VerifiedTokens:
    run: VerifiedRun
    # One entry per token of run.token_ids when the request asked for logprobs.
    logprobs: list[dict[int, float]] | None


class Speculator:
    """Drafting rule, per step: a sequence drafts when it is decoding (its prompt is done),
    its request has n == 1 and no prompt logprobs, and at most
    `config.disable_by_batch_size` sequences are running; it drafts at most
    num_speculative_tokens, fewer near max_tokens or the context limit. Everyone else
    decodes plainly in the same batch."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()

    def _num_to_draft(self, seq: Sequence) -> int:
        request = seq.request
        if (
            request.params.n != 1
            or request.params.prompt_logprobs is not None
            or seq.status is not SequenceStatus.RUNNING
            or seq.num_tokens - seq.num_computed_tokens != 1
        ):
            return 0
        # Room for the drafts plus the target's own token within both limits.
        room_output = request.max_tokens - len(seq.output_token_ids) - 1
        room_context = self.max_model_len - seq.num_tokens - 1
        return max(0, min(self.config.num_speculative_tokens, room_output, room_context))

    def propose(self, running: list[Sequence]) -> None:
        """Set each running sequence's drafts for the coming step."""
        for seq in running:
            seq.clear_drafts()
        if len(running) > self.config.disable_by_batch_size:
            return
        seqs, budgets = [], []
        for seq in running:
            k = self._num_to_draft(seq)
            if k > 0:
                seqs.append(seq)
                budgets.append(k)
        if not seqs:
            return
        for seq, draft in zip(seqs, self.proposer.propose(seqs, budgets)):
            seq.spec_token_ids = draft.token_ids
            seq.spec_draft_probs = draft.probs

    def release(self, running: list[Sequence]) -> None:
        """Free the drafting state (a draft model's KV blocks) of every sequence that is no
        longer running: finished, aborted or preempted."""
        self.proposer.retain(seq.seq_id for seq in running)

    def verify(
        self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Seq[int]
    ) -> list[VerifiedTokens]:
        """logits: per sequence (in order) 1 + len(spec_token_ids) rows."""
        rows: list[SamplingRow] = []
        for seq in seqs:
            drafts = seq.spec_token_ids
            for j in range(len(drafts) + 1):
                # Row j is reached only if drafts[:j] were accepted: penalties and
                # min_tokens see them as already generated.
                rows.append(SamplingRow(
                    params=seq.request.params,
                    prompt_token_ids=seq.prompt_token_ids,
                    output_token_ids=seq.output_token_ids + drafts[:j],
                    generator=seq.generator,
                    eos_token_ids=eos_token_ids,
                ))
        runs = rejection_sample(
            final_probs(logits, rows),
            [DraftVerification(seq.spec_token_ids, seq.spec_draft_probs, seq.generator)
             for seq in seqs],
        )
        results, offset = [], 0
        for seq, run in zip(seqs, runs):
            self.stats.observe(len(seq.spec_token_ids), run.num_accepted)
            seq.request.spec_stats.observe(len(seq.spec_token_ids), run.num_accepted)
            logprobs = None
            num_top = seq.request.params.logprobs
            if num_top is not None:
                emitted = logits[offset : offset + len(run.token_ids)]
                logprobs = gather_logprobs(emitted, run.token_ids, [num_top] * len(run.token_ids))
            results.append(VerifiedTokens(run, logprobs))
            offset += len(seq.spec_token_ids) + 1
        return results
