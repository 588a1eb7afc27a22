"""What the engine hands back to callers (shaped like vLLM's outputs)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.spec_decode.stats import SpecDecodeStats


@dataclass
class CompletionOutput:
    index: int
    # Text so far. While unfinished it may hold back a few characters that could still
    # turn out to start a stop string, so it is always a prefix of the final text.
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # Per generated token: {token id: logprob} for the sampled token and the top alternatives.
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop", "length", "abort"
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
