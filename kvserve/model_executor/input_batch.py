"""What a model runner holds of each sequence between steps, kept current from each
step's SchedulerOutput."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvserve.core.sched.output import SchedulerOutput
from kvserve.multimodal.inputs import ImageFeature
from kvserve.sampling_params import SamplingParams


class TokenSpan(Sequence[int]):
    """tokens[start:stop] without the copy (the sampler reads a sequence's prompt and
    outputs every step, but rarely more than their length)."""

    __slots__ = ("_tokens", "_start", "_stop")

    def __init__(self, tokens: list[int], start: int, stop: int | None = None) -> None:
        self._tokens, self._start, self._stop = tokens, start, stop

    def _end(self) -> int:
        return len(self._tokens) if self._stop is None else self._stop

    def __len__(self) -> int:
        return self._end() - self._start

    def __getitem__(self, index):  # type: ignore[override]
        return self._tokens[self._start : self._end()][index]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, self._end())


@dataclass
class RunnerSequence:
    token_ids: list[int]  # known tokens: prompt, then outputs (not the drafts)
    num_prompt_tokens: int
    num_computed_tokens: int  # as of the step being run
    block_ids: array  # int32, copied as they are into the step's block tables
    wants_prompt_logprobs: bool
    params: SamplingParams | None  # None: not sampled by the runner
    sample_index: int
    max_tokens: int
    lora_int_id: int  # 0: the base model
    mm_features: list[ImageFeature] = field(default_factory=list)
    # M-RoPE models: the prompt's [3, P] positions and the offset of every later token's
    # position from its index (computed by the runner on first use).
    mrope: tuple[torch.Tensor, int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


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
                array("i", new.block_ids), new.wants_prompt_logprobs, new.params,
                new.sample_index, new.max_tokens,
                0 if new.lora_request is None else new.lora_request.lora_int_id, new.mm_features,
            )
        for cached in out.cached_seqs:
            state = self[cached.seq_id]
            state.token_ids.extend(cached.new_token_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.num_kept_blocks < len(state.block_ids):
                del state.block_ids[cached.num_kept_blocks:]
            state.block_ids.extend(cached.new_block_ids)
