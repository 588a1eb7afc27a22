"""The runner's side of speculative decoding: who drafts for the next step, and verifying
drafts against the target's logits of one forward pass."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvserve.sample.sampler import Sampler, SamplingRow, final_probs, gather_logprobs
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.proposer import Draft, DraftContext, Proposer
from kvserve.spec_decode.rejection_sampler import (
    DraftVerification,
    VerifiedRun,
    greedy_run,
    greedy_tree_run,
    rejection_sample,
    tree_rejection_run,
)


@dataclass
class VerifiedTokens:
    run: VerifiedRun
    # One entry per token of run.token_ids when the request asked for logprobs.
    logprobs: list[dict[int, float]] | None


class Speculator:
    """Drafting rule, per step: a sequence drafts when it has just got tokens, its request
    has n == 1 and no prompt logprobs, and at most `config.disable_by_batch_size`
    sequences got tokens in the step; it drafts at most num_speculative_tokens, fewer near
    max_tokens or the context limit. Everyone else decodes plainly in the same batch."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        # The distributions each sequence's pending drafts were sampled from (None: one-hot).
        self._draft_probs: dict[str, torch.Tensor | None] = {}

    @staticmethod
    def drafts_for(params: SamplingParams) -> bool:
        """Whether requests with these parameters ever draft: not those that fork into n
        samples or score their prompt."""
        return params.n == 1 and params.prompt_logprobs is None

    def _num_to_draft(self, seq: DraftContext) -> int:
        if not self.drafts_for(seq.params):
            return 0
        # Room for the drafts plus the target's own token within both limits.
        room_output = seq.max_tokens - len(seq.output_token_ids) - 1
        room_context = self.max_model_len - seq.num_tokens - 1
        return max(0, min(self.config.num_speculative_tokens, room_output, room_context))

    @property
    def needs_hidden_states(self) -> bool:
        return self.proposer.needs_hidden_states

    @property
    def reads_step_features(self) -> bool:
        """Whether the proposer reads every verified row's hidden state (EAGLE), through
        observe_features, not only the newest token's."""
        return getattr(self.proposer, "reads_step_features", False)

    def observe_features(self, seq_id: str, first_position: int, features: torch.Tensor) -> None:
        self.proposer.observe(seq_id, first_position, features)

    def speculates_at(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` sequences drafts (and, for EAGLE, hands the head
        its features): not past disable_by_batch_size."""
        return batch_size <= self.config.disable_by_batch_size

    def propose(self, candidates: list[DraftContext], batch_size: int) -> dict[str, Draft]:
        """The drafts of each candidate's next step (sequences with none are left out)."""
        if not self.speculates_at(batch_size):
            return {}
        seqs, budgets = [], []
        for seq in candidates:
            k = self._num_to_draft(seq)
            if k > 0:
                seqs.append(seq)
                budgets.append(k)
        if not seqs:
            return {}
        drafts = {}
        for seq, draft in zip(seqs, self.proposer.propose(seqs, budgets)):
            if draft.token_ids:
                drafts[seq.seq_id] = draft
                self._draft_probs[seq.seq_id] = draft.probs
        return drafts

    def retain(self, seq_ids: Iterable[str]) -> None:
        """Free the drafting state (a draft model's KV blocks, pending drafts' distributions)
        of every sequence not in `seq_ids`: finished, aborted or preempted."""
        keep = set(seq_ids)
        for seq_id in [s for s in self._draft_probs if s not in keep]:
            del self._draft_probs[seq_id]
        self.proposer.retain(keep)

    def verify(
        self,
        logits: torch.Tensor,
        seqs: list[DraftContext],
        drafts: list[list[int]],
        eos_token_ids: Seq[int],
        tree_parents: list[list[int] | None] | None = None,
    ) -> list[VerifiedTokens]:
        """logits: per sequence (in order) 1 + len(drafts[i]) rows: the last verified token's,
        then each draft's. `drafts` are the ones the step carried: a prefix of what was
        proposed when the token budget cut them. tree_parents[i]: the drafts' tree (parent of
        each, -1 the last verified token), None for a chain."""
        parents_of = tree_parents or [None] * len(seqs)
        greedy_rows, greedy_runs, rows, logit_rows, verifications, tree_runs = [], [], [], [], [], []
        offset = 0
        for i, (seq, seq_drafts, parents) in enumerate(zip(seqs, drafts, parents_of)):
            seq_rows = [SamplingRow(
                params=seq.params,
                prompt_token_ids=seq.prompt_token_ids,
                # A row is reached only if the drafts on its path were accepted: penalties
                # and min_tokens see them as already generated.
                output_token_ids=seq.output_token_ids + path_tokens(seq_drafts, parents, j),
                generator=seq.generator,
                eos_token_ids=eos_token_ids,
            ) for j in range(len(seq_drafts) + 1)]
            probs = self._draft_probs.pop(seq.seq_id, None)
            row_range = range(offset, offset + len(seq_rows))
            offset += len(seq_rows)
            if seq.params.is_greedy:
                # The target's distribution is one-hot: a draft is accepted while it is the
                # argmax, whatever distribution it came from. The argmax is taken as a plain
                # decode step takes it, with no softmax or noise over the vocabulary.
                greedy_rows.extend(row_range)
                greedy_runs.append((i, seq_rows))
                continue
            if parents is not None:
                tree_runs.append((i, row_range, seq_rows))
                continue
            rows.extend(seq_rows)
            logit_rows.extend(row_range)
            verifications.append(DraftVerification(
                seq_drafts, None if probs is None else probs[: len(seq_drafts)], seq.generator))
        runs: list[VerifiedRun | None] = [None] * len(seqs)
        if greedy_rows:
            targets = Sampler.sample_ids(logits[greedy_rows], [r for _, seq_rows in greedy_runs for r in seq_rows])
            targets_h, start = targets.tolist(), 0
            for i, seq_rows in greedy_runs:
                seq_targets = targets_h[start : start + len(seq_rows)]
                start += len(seq_rows)
                runs[i] = (greedy_run(drafts[i], seq_targets) if parents_of[i] is None
                           else greedy_tree_run(drafts[i], parents_of[i], seq_targets))
        for i, row_range, seq_rows in tree_runs:
            probs = final_probs(logits[list(row_range)], seq_rows)
            runs[i] = tree_rejection_run(probs, drafts[i], parents_of[i], seqs[i].generator)
        if verifications:
            sampled = iter(rejection_sample(final_probs(logits[logit_rows], rows), verifications))
            runs = [run if run is not None else next(sampled) for run in runs]
        results, offset = [], 0
        for seq, seq_drafts, run in zip(seqs, drafts, runs):
            logprobs = None
            num_top = seq.params.logprobs
            if num_top is not None:
                emitted = logits[[offset + row for row in run.rows]]
                logprobs = gather_logprobs(emitted, run.token_ids, [num_top] * len(run.token_ids))
            results.append(VerifiedTokens(run, logprobs))
            offset += len(seq_drafts) + 1
        return results


def path_tokens(drafts: list[int], parents: list[int] | None, row: int) -> list[int]:
    """The drafts a verify row comes after: none for row 0 (the last verified token's), the
    path from the root to draft j, j included, for row 1 + j (which predicts what follows)."""
    if parents is None:
        return drafts[:row]
    path, node = [], row - 1
    while node != -1:
        path.append(drafts[node])
        node = parents[node]
    return path[::-1]
