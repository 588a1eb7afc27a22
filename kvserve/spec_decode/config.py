"""`speculative_config` as users pass it (vLLM's keys), validated at engine start."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvserve.quantization import QUANTIZATION_METHODS

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# Speculation pays while a decode step is bound by reading the weights: verifying k extra
# tokens per sequence is then almost free. With many sequences running, the step already
# moves enough rows to be compute bound and the drafts' extra rows cost real time, so past
# this many running sequences nobody speculates that step (vLLM's disable_by_batch_size).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


def _error(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"speculative_config: {name}={value!r} is invalid; allowed: {allowed}")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the longest suffix n-gram (n from max down to min) found earlier in the
    # request's prompt + output proposes what followed it.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft_model: a model directory / .gguf with the target's vocabulary, or "same".
    model: str | None = None
    quantization: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise _error(unknown[0], config[unknown[0]], f"keys {sorted(known)}")
        for required in ("method", "num_speculative_tokens"):
            if required not in config:
                raise ValueError(f"speculative_config needs {required!r}")
        return cls(**config)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise _error("method", self.method, f"one of {list(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise _error("num_speculative_tokens", k, f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.disable_by_batch_size < 1:
            raise _error("disable_by_batch_size", self.disable_by_batch_size, "an integer >= 1")
        if self.method == "ngram":
            if self.prompt_lookup_min < 1:
                raise _error("prompt_lookup_min", self.prompt_lookup_min, "an integer >= 1")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise _error(
                    "prompt_lookup_min", self.prompt_lookup_min,
                    f"<= prompt_lookup_max ({self.prompt_lookup_max})",
                )
        else:
            if not self.model:
                raise _error("model", self.model, "a model path or 'same' for method draft_model")
            if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
                raise _error("quantization", self.quantization, f"one of {list(QUANTIZATION_METHODS)}")
