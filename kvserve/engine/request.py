"""A user request: one prompt, its sampling parameters, and the sequences sampling it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvserve.core.sequence import Sequence
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.stats import SpecDecodeStats


@dataclass
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    sequences: list[Sequence] = field(default_factory=list)
    # One entry per prompt token (None for the first, which has no context).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finished: bool = False
    max_tokens: int = 0  # resolved against the context length at admission
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    def __post_init__(self) -> None:
        self.times = RequestTimes(arrival=self.arrival_time)
