"""The engine core's record of a request: its parameters and the sequences sampling it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.sequence import Sequence
from kvserve.multimodal.inputs import ImageFeature
from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length at admission
    priority: int = 0
    arrival_time: float = 0.0
    sequences: list[Sequence] = field(default_factory=list)
    scheduled: bool = False  # scheduled at least once
    # Prompt positions whose logprobs were sent (the first has none: it has no context).
    num_prompt_logprobs: int = 1
    mm_features: list[ImageFeature] = field(default_factory=list)  # the prompt's images
    lora_request: LoRARequest | None = None  # None: the base model

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id
