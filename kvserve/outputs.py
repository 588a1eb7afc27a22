"""What the engine hands back to callers (shaped like vLLM's outputs)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

from kvserve.spec_decode.stats import SpecDecodeStats

T = TypeVar("T")


class GrowingListPrefix(Sequence[T], Generic[T]):
    """The first `length` items of a list that is only ever appended to: a snapshot taken in
    O(1). A streamed request's output each step shows its tokens so far; copying them every
    step cost O(tokens) a step a request (quadratic over a long stream)."""

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[T]) -> None:
        self._items = items
        self._length = len(items)

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return self._items[slice(*index.indices(self._length))]
        if not -self._length <= index < self._length:
            raise IndexError("index out of range")
        return self._items[index % self._length]

    def __iter__(self) -> Iterator[T]:
        return iter(self._items[: self._length])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (GrowingListPrefix, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._items[: self._length])


@dataclass
class CompletionOutput:
    index: int
    # Text so far. While unfinished it may hold back a few characters that could still
    # turn out to start a stop string, so it is always a prefix of the final text.
    text: str
    # Lists once finished; while a request streams, GrowingListPrefix views of the engine's
    # own lists (read-only: they hold what was generated when the output was made).
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    # Per generated token: {token id: logprob} for the sampled token and the top alternatives.
    logprobs: Sequence[dict[int, float]] | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    # The stop string or stop token id that ended the sequence (None for EOS or length).
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    # Speculative decoding of this request (mean_accepted_length, acceptance_rate); None
    # when the engine does not speculate.
    spec_decode: SpecDecodeStats | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # Why the engine failed this request alone (its samples end with finish_reason "error").
    error: str | None = None
