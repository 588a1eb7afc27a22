"""A sequence is the unit the scheduler runs: one prompt and one stream of generated tokens.

A request with `n` samples starts as one sequence; when its prompt is done it forks into
`n` sequences that share the prompt's KV blocks (see KVCacheManager.fork).
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from kvserve.sampling_params import SamplingParams


class SequenceOwner(Protocol):
    """What a sequence reads of the request it samples (the engine's Request)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    priority: int
    arrival_time: float
    max_tokens: int


class TextStream(Protocol):
    """Turns a sequence's tokens into text as they arrive (the engine's detokenizer)."""

    def add_tokens(self, token_ids: list[int]) -> str | None: ...

    def take_delta(self, finished: bool) -> str: ...


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
        generator: torch.Generator | None,
        detokenizer: TextStream | None,
    ) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index  # which of the request's n samples this is
        self.prompt_token_ids: list[int] = request.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.generator = generator
        self.detokenizer = detokenizer
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.stop_reason: str | int | None = None
        self.emitted_text = ""  # text handed out so far (a prefix of the final text)
        self.num_preemptions = 0
        # Drafted continuation to verify in the next step (speculative decoding): not part
        # of the sequence until accepted. `spec_draft_probs` [k, V] are the distributions
        # the drafts were sampled from (None: one-hot, e.g. n-gram or greedy drafts).
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: torch.Tensor | None = None
        # Parent of each draft (-1: the last verified token) when the drafts form a tree
        # rather than a chain; the verify pass then attends each along its own path.
        self.spec_tree_parents: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

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
        self.spec_draft_probs = None
        self.spec_tree_parents = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
