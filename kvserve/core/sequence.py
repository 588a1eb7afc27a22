"""A sequence is the unit the scheduler runs: one prompt and one stream of generated tokens.

A request with `n` samples starts as one sequence; when its prompt is done it forks into
`n` sequences that share the prompt's KV blocks (see KVCacheManager.fork).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from typing import Protocol

from kvserve.multimodal.inputs import ImageFeature
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams


class SequenceOwner(Protocol):
    """What a sequence reads of the request it samples (the engine core's request)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    priority: int
    arrival_time: float
    max_tokens: int
    sequences: list[Sequence]
    mm_features: list[ImageFeature]
    lora_request: LoRARequest | None
    lora_int_id: int  # 0: the base model


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


class Sequence:
    def __init__(
        self,
        seq_id: str,
        request: SequenceOwner,
        index: int,
    ) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index  # which of the request's n samples this is
        self.prompt_token_ids: list[int] = request.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | None = None  # the stop token id that ended it
        self.num_preemptions = 0
        # Drafted continuation to verify in the next step (speculative decoding): not part
        # of the sequence until accepted. The runner that drafted them keeps what else
        # verifying needs (the distributions they were sampled from).
        self.spec_token_ids: list[int] = []
        # Parent of each draft (-1: the last verified token) when the drafts form a tree
        # rather than a chain; the verify pass then attends each along its own path.
        self.spec_tree_parents: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def mm_features(self) -> list[ImageFeature]:
        return self.request.mm_features

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.request.params.prompt_logprobs is not None

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """After preemption: the KV is gone; prompt and outputs so far are recomputed."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.clear_drafts()

    def clear_drafts(self) -> None:
        self.spec_token_ids = []
        self.spec_tree_parents = None

    def fork(self, index: int) -> Sequence:
        """Sample `index` of the request, branching off at this sequence's tokens (its KV
        blocks are shared by the caller)."""
        child = Sequence(f"{self.request.request_id}#{index}", self.request, index)
        self.request.sequences.append(child)
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


def check_stop(
    token_id: int,
    num_output_tokens: int,
    num_tokens: int,
    params: SamplingParams,
    max_tokens: int,
    eos_token_ids: Seq[int],
    max_model_len: int | None,
) -> tuple[SequenceStatus | None, int | None]:
    """Whether the token just appended ends its sequence, and the stop token id if one
    did. Stop strings are matched on text, by whoever detokenizes."""
    if num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED, token_id
        if not params.ignore_eos and token_id in eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED, None
    if num_output_tokens >= max_tokens or (max_model_len is not None and num_tokens >= max_model_len):
        return SequenceStatus.FINISHED_LENGTH, None
    return None, None
