"""What a model runner holds of each sequence between steps, kept current from each
step's SchedulerOutput."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from kvserve.core.sched.output import SchedulerOutput


@dataclass
class RunnerSequence:
    token_ids: list[int]  # known tokens: prompt, then outputs (not the drafts)
    num_prompt_tokens: int
    num_computed_tokens: int  # as of the step being run
    block_ids: array  # int32, copied as they are into the step's block tables
    wants_prompt_logprobs: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class SequenceStates(dict[str, RunnerSequence]):
    def apply(self, out: SchedulerOutput) -> None:
        """Forget what the step says is gone, take in new sequences, apply the deltas."""
        for seq_id in out.finished_seq_ids:
            self.pop(seq_id, None)
        for seq_id in out.preempted_seq_ids:
            self.pop(seq_id, None)
        for new in out.new_seqs:
            self[new.seq_id] = RunnerSequence(
                new.token_ids, new.num_prompt_tokens, new.num_computed_tokens,
                array("i", new.block_ids), new.wants_prompt_logprobs,
            )
        for cached in out.cached_seqs:
            state = self[cached.seq_id]
            state.token_ids.extend(cached.new_token_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.num_kept_blocks < len(state.block_ids):
                del state.block_ids[cached.num_kept_blocks:]
            state.block_ids.extend(cached.new_block_ids)
