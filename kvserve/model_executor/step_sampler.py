"""Turns a step's logits into its ModelRunnerOutput: a token for every sequence that
samples (and for each sample a prompt forks into), verified runs for sequences with
drafts, prompt logprobs, and the drafts of the next step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvserve.core.sched.output import ModelRunnerOutput, SampledSequence, SchedulerOutput
from kvserve.core.sequence import check_stop
from kvserve.model_executor.inflight import InflightStep
from kvserve.model_executor.input_batch import RunnerSequence, SequenceStates, TokenSpan
from kvserve.sample.sampler import Sampler, SamplingRow, compute_prompt_logprobs
from kvserve.spec_decode.proposer import DraftContext
from kvserve.spec_decode.speculator import Speculator
from kvserve.structured_output.matchers import ConstrainedRows, GrammarMatchers


class StepSampler:
    def __init__(self, device: torch.device, eos_token_ids: Sequence[int], max_model_len: int | None,
                 tokenizer=None, vocab_size: int = 0) -> None:
        """`tokenizer`, `vocab_size`: the vocabulary structured outputs constrain (the
        front refuses constrained requests without a tokenizer)."""
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.sampler = Sampler()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # A seeded sequence's generator lives as long as the sequence (a preemption keeps
        # it), so its draws do not depend on what else ran. Grammar matchers likewise.
        self._generators: dict[str, torch.Generator] = {}
        self._grammars: GrammarMatchers | None = None  # made by the first constrained request

    def forget(self, seq_ids: Iterable[str]) -> None:
        """Finished or aborted sequences."""
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)
        if self._grammars is not None:
            self._grammars.forget(seq_ids)

    def prepare(self, sched: SchedulerOutput) -> None:
        """Start compiling the grammars of constrained sequences new to the runner, so the
        compile overlaps the step's forward pass."""
        for new in sched.new_seqs:
            if new.params is not None and new.params.structured_outputs is not None:
                self.grammars.prefetch(new.params.structured_outputs)

    @property
    def grammars(self) -> GrammarMatchers:
        if self._grammars is None:
            self._grammars = GrammarMatchers(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def generator(self, seq_id: str, seq: RunnerSequence, index: int | None = None) -> torch.Generator | None:
        seed = seq.params.seed
        if seed is None:
            return None
        generator = self._generators.get(seq_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed + (seq.sample_index if index is None else index))
            self._generators[seq_id] = generator
        return generator

    def row(self, seq_id: str, seq: RunnerSequence, index: int | None = None) -> SamplingRow:
        """`index`: a sample the sequence forks into (sampled from its logits)."""
        return SamplingRow(
            params=seq.params,
            prompt_token_ids=TokenSpan(seq.token_ids, 0, seq.num_prompt_tokens),
            output_token_ids=TokenSpan(seq.token_ids, seq.num_prompt_tokens),
            generator=self.generator(seq_id, seq, index),
            eos_token_ids=self.eos_token_ids,
        )

    def sample_ids(self, logits: torch.Tensor, seq_ids: list[str], seqs: SequenceStates,
                   in_flight: InflightStep | None = None) -> torch.Tensor:
        """One id per sequence, left on the device (overlapped decode steps). `in_flight`:
        the step still running, whose sampled tokens the grammars of constrained sequences
        must see before this step's masks. Reading them waits only for that step: this
        step's forward is already queued behind it, and the host fills the masks meanwhile."""
        rows = [self.row(seq_id, seqs[seq_id]) for seq_id in seq_ids]
        constrained = [i for i, row in enumerate(rows) if row.params.structured_outputs is not None]
        if constrained:
            pending = {} if in_flight is None else dict(zip(in_flight.seq_ids, in_flight.read()))
            self.grammars.mask_logits(logits, [
                ConstrainedRows(seq_ids[i], rows[i].params.structured_outputs, rows[i].output_token_ids, i,
                                pending_token_ids=(pending[seq_ids[i]],) if seq_ids[i] in pending else ())
                for i in constrained
            ])
        return self.sampler.sample_ids(logits, rows)

    def sample(
        self,
        sched: SchedulerOutput,
        seqs: SequenceStates,
        sample_logits: torch.Tensor,
        sampling_seq_ids: list[str],
        num_sample_rows: list[int],
        prompt_logits: list[tuple[str, torch.Tensor, int]],
        speculator: Speculator | None,
        sample_hidden: torch.Tensor | None = None,
        step_hidden: torch.Tensor | None = None,
    ) -> ModelRunnerOutput:
        """`sample_hidden`: the target's hidden states at the logits' rows, which draft heads
        read (the row that predicted each sequence's newest token); `step_hidden`: every
        row's, in the step's order (EAGLE pairs each verified position's with the next token)."""
        out = ModelRunnerOutput()
        for seq_id, logits, first_target in prompt_logits:
            seq = seqs[seq_id]
            targets = seq.token_ids[first_target : first_target + logits.shape[0]]
            try:
                entries = compute_prompt_logprobs(logits, targets, seq.params.prompt_logprobs)
            except Exception as error:
                out.failed[seq_id] = repr(error)
                continue
            out.prompt_logprobs.append((seq_id, first_target, entries))

        self._mask_constrained(sched, seqs, sample_logits, sampling_seq_ids, num_sample_rows)
        # Plain decodes and prefills sample one row; sequences with drafts verify 1 + k.
        plain_ids, plain_rows, spec_ids, spec_rows = [], [], [], []
        row = 0
        for seq_id, num_rows in zip(sampling_seq_ids, num_sample_rows):
            if num_rows == 1:
                plain_ids.append(seq_id)
                plain_rows.append(row)
            else:
                spec_ids.append(seq_id)
                spec_rows.extend(range(row, row + num_rows))
            row += num_rows

        hidden_rows: dict[str, int] = dict(zip(plain_ids, plain_rows))
        verified_rows: dict[str, tuple[int, list[int]]] = {}
        rows, row_seq_ids, logit_rows = [], [], []
        for logit_row, seq_id in enumerate(plain_ids):
            seq = seqs[seq_id]
            rows.append(self.row(seq_id, seq))
            row_seq_ids.append(seq_id)
            logit_rows.append(plain_rows[logit_row])
            for child_id, index in sched.forks.get(seq_id, ()):
                rows.append(self.row(child_id, seq, index))
                row_seq_ids.append(child_id)
                logit_rows.append(plain_rows[logit_row])
        if rows:
            for seq_id, token_id, logprobs in self._sample_rows(sample_logits, logit_rows, rows, row_seq_ids, out):
                out.sampled.append(SampledSequence(seq_id, [token_id], None if logprobs is None else [logprobs]))
        if spec_ids:
            drafts = [sched.spec_token_ids[seq_id] for seq_id in spec_ids]
            tree_parents = [sched.spec_tree_parents.get(seq_id) for seq_id in spec_ids]
            verified = speculator.verify(
                sample_logits[spec_rows],
                [self._draft_context(seq_id, seqs[seq_id]) for seq_id in spec_ids],
                drafts, self.eos_token_ids,
                [None if parents is None else parents[: len(d)] for parents, d in zip(tree_parents, drafts)],
            )
            first_row = 0
            for seq_id, seq_drafts, result in zip(spec_ids, drafts, verified):
                run = result.run
                out.sampled.append(SampledSequence(
                    seq_id, run.token_ids, result.logprobs, len(seq_drafts), run.num_accepted,
                    run.num_in_place,
                ))
                hidden_rows[seq_id] = spec_rows[first_row + run.rows[-1]]
                verified_rows[seq_id] = (len(seq_drafts), run.rows)
                first_row += len(seq_drafts) + 1
        # Past disable_by_batch_size nobody drafts, so the head is handed nothing to keep
        # (it restarts a sequence's pairs where the features resume).
        if (speculator is not None and speculator.reads_step_features and step_hidden is not None
                and speculator.speculates_at(len(sched.num_scheduled_tokens))):
            self._observe_features(sched, seqs, verified_rows, step_hidden, speculator)
        if speculator is not None:
            hidden = sample_hidden if speculator.needs_hidden_states else None
            proposed = speculator.propose(self._drafting(out.sampled, seqs, hidden, hidden_rows), len(out.sampled))
            out.draft_token_ids = {seq_id: draft.token_ids for seq_id, draft in proposed.items()}
            out.draft_tree_parents = {seq_id: draft.parents for seq_id, draft in proposed.items()
                                      if draft.parents is not None}
            if self._grammars is not None:
                self._check_drafts(out, seqs)
        return out

    @staticmethod
    def _observe_features(sched: SchedulerOutput, seqs: SequenceStates,
                          verified_rows: dict[str, tuple[int, list[int]]], step_hidden: torch.Tensor,
                          speculator: Speculator) -> None:
        """Each sequence's verified rows: all it ran but the rejected drafts (`verified_rows`:
        a verifying sequence's draft count and the rows of its emitted tokens among its last
        1 + drafts: the newest token's, then the accepted path's, which in a tree skip the
        other branches). Sequences that never draft are skipped: their features would be
        kept for as long as they run."""
        flat = 0
        for seq_id, num in sched.num_scheduled_tokens.items():
            if not speculator.drafts_for(seqs[seq_id].params):
                flat += num
                continue
            rows = list(range(num))
            if seq_id in verified_rows:
                num_drafts, path_rows = verified_rows[seq_id]
                offset = num - num_drafts - 1
                rows = rows[:offset] + [offset + row for row in path_rows]
            features = (step_hidden[flat : flat + len(rows)] if rows == list(range(len(rows)))
                        else step_hidden[[flat + row for row in rows]])
            speculator.observe_features(seq_id, seqs[seq_id].num_computed_tokens, features)
            flat += num

    def _sample_rows(
        self, logits: torch.Tensor, logit_rows: list[int], rows: list[SamplingRow], seq_ids: list[str],
        out: ModelRunnerOutput,
    ) -> list[tuple[str, int, dict[int, float] | None]]:
        """(seq id, token, logprobs) of every row that samples. A request's own parameters
        can still break the batched call; then each row is sampled alone, from the seeded
        generators' states before the failed call, and a row that raises fails only its
        sequence (out.failed)."""
        generators = [row.generator for row in rows if row.generator is not None]
        states = [generator.get_state() for generator in generators]
        try:
            sampled = self.sampler(logits[logit_rows], rows)
            return list(zip(seq_ids, sampled.token_ids, sampled.logprobs))
        except Exception:
            for generator, state in zip(generators, states):
                generator.set_state(state)
        results = []
        for seq_id, logit_row, row in zip(seq_ids, logit_rows, rows):
            try:
                sampled = self.sampler(logits[logit_row : logit_row + 1], [row])
            except Exception as error:
                out.failed[seq_id] = repr(error)
                continue
            results.append((seq_id, sampled.token_ids[0], sampled.logprobs[0]))
        return results

    def _mask_constrained(self, sched: SchedulerOutput, seqs: SequenceStates, sample_logits: torch.Tensor,
                          sampling_seq_ids: list[str], num_sample_rows: list[int]) -> None:
        """The grammar's bitmask on the rows of constrained sequences, before every other
        transform (a fork's samples share their parent's row: all start at the grammar's
        beginning)."""
        constrained, row = [], 0
        for seq_id, num_rows in zip(sampling_seq_ids, num_sample_rows):
            seq = seqs[seq_id]
            if seq.params.structured_outputs is not None:
                constrained.append(ConstrainedRows(
                    seq_id, seq.params.structured_outputs, TokenSpan(seq.token_ids, seq.num_prompt_tokens),
                    row, sched.spec_token_ids.get(seq_id, [])[: num_rows - 1],
                ))
            row += num_rows
        if constrained:
            self.grammars.mask_logits(sample_logits, constrained)

    def _check_drafts(self, out: ModelRunnerOutput, seqs: SequenceStates) -> None:
        """Cut each constrained sequence's drafts at the first token its grammar refuses:
        verifying it would be wasted."""
        new_token_ids = {item.seq_id: item.token_ids for item in out.sampled}
        for seq_id, drafts in list(out.draft_token_ids.items()):
            seq = seqs[seq_id]
            if seq.params.structured_outputs is None:
                continue
            if seq_id in out.draft_tree_parents:  # grammars check chains: no tree drafting
                del out.draft_token_ids[seq_id], out.draft_tree_parents[seq_id]
                continue
            allowed = self._grammars.allowed_drafts(
                seq_id, seq.params.structured_outputs, TokenSpan(seq.token_ids, seq.num_prompt_tokens),
                new_token_ids[seq_id], drafts,
            )
            if allowed:
                out.draft_token_ids[seq_id] = allowed
            else:
                del out.draft_token_ids[seq_id]

    def _draft_context(self, seq_id: str, seq: RunnerSequence, new_token_ids: Sequence[int] = (),
                       hidden_state: torch.Tensor | None = None) -> DraftContext:
        return DraftContext(
            seq_id, seq.token_ids + list(new_token_ids) if new_token_ids else seq.token_ids,
            seq.num_prompt_tokens, seq.params, seq.max_tokens, self.generator(seq_id, seq), hidden_state,
        )

    def _drafting(self, sampled: list[SampledSequence], seqs: SequenceStates,
                  hidden: torch.Tensor | None = None, hidden_rows: dict[str, int] | None = None,
                  ) -> list[DraftContext]:
        """Sequences that may draft for their next step: those that got tokens and did
        not end with them (a stop string is only seen on text: drafting then is wasted).
        The samples a prompt forked into are not among them: n > 1 does not draft."""
        contexts = []
        for item in sampled:
            seq = seqs.get(item.seq_id)
            if seq is None or seq.params.n != 1:
                continue
            num_output = seq.num_tokens - seq.num_prompt_tokens
            if not any(
                check_stop(token_id, num_output + i + 1, seq.num_tokens + i + 1, seq.params,
                           seq.max_tokens, self.eos_token_ids, self.max_model_len)[0]
                for i, token_id in enumerate(item.token_ids)
            ):
                hidden_state = None if hidden is None else hidden[hidden_rows[item.seq_id]]
                contexts.append(self._draft_context(item.seq_id, seq, item.token_ids, hidden_state))
        return contexts
