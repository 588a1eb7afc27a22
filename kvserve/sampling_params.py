"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from kvserve.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
_GREEDY_EPS = 1e-5
# torch.Generator.manual_seed's inclusive range; sequence i of a request is seeded seed + i.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Integers the sampler puts into int64 tensors must fit them.
INT64_MAX = 2**63 - 1
# Float parameters become rows of float32 (or narrower) tensors: a larger value turns into
# inf there and the row's logits into NaN.
FLOAT32_MAX = 3.4028234663852886e38
# Fields the engine uses as integers (counts, ranges, seeds) and as floats: another type
# would raise inside a step, where it would fail every request in the batch.
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Decoding constrained to a JSON schema, regex, choice or grammar (a dict is read as
    # StructuredOutputsParams' fields).
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._normalize_numbers()
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_token_ids(self.stop_token_ids)
        if self.logit_bias is not None:
            # JSON clients send token ids as string keys ("50256": -100).
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(
                    f"logit_bias must map token ids to floats, got {self.logit_bias!r}"
                ) from e
            bad = {k: v for k, v in self.logit_bias.items() if not abs(v) <= FLOAT32_MAX}
            if bad:
                token, bias = next(iter(bad.items()))
                raise ValueError(f"logit_bias values must be finite float32 numbers, got "
                                 f"logit_bias[{token}]={bias!r}")
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict, got "
                             f"{type(self.structured_outputs).__name__}")
        self._validate()

    def _normalize_numbers(self) -> None:
        """Integers (numpy's too, and whole floats such as 2.0) as int, reals as float."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name not in ("n", "top_k", "min_tokens"):
                continue
            integral = isinstance(value, numbers.Integral) or (
                isinstance(value, numbers.Real) and float(value).is_integer())
            if isinstance(value, bool) or not integral:
                raise ValueError(f"{name} must be an integer, got {name}={value!r}")
            setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {name}={value!r}")
            setattr(self, name, float(value))

    def _validate(self) -> None:
        _check(self.n >= 1, "n", self.n, "n >= 1")
        if self.seed is not None:
            _check(SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1), "seed", self.seed,
                   f"{SEED_MIN} <= seed and seed + n - 1 <= {SEED_MAX} (n={self.n})")
        _check(0 <= self.temperature <= FLOAT32_MAX, "temperature", self.temperature,
               "0 <= temperature <= 3.4e38 (a finite float32)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "0 < top_p <= 1")
        _check(self.top_k == -1 or 1 <= self.top_k <= INT64_MAX, "top_k", self.top_k,
               f"top_k == -1 (disabled) or 1 <= top_k <= {INT64_MAX}")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "0 <= min_p <= 1")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty,
               "-2 <= presence_penalty <= 2")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty,
               "-2 <= frequency_penalty <= 2")
        _check(0 < self.repetition_penalty <= FLOAT32_MAX, "repetition_penalty",
               self.repetition_penalty, "0 < repetition_penalty <= 3.4e38 (a finite float32)")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "max_tokens >= 1 or None")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "min_tokens >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"min_tokens <= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs,
               "logprobs >= 0 or None")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
               self.prompt_logprobs, "prompt_logprobs >= 0 or None")

    def verify_token_ids(self, vocab_size: int) -> None:
        """Reject token ids the model cannot produce (needs the vocab size, unknown here)."""
        for name, ids in (("logit_bias", self.logit_bias or {}),
                          ("stop_token_ids", self.stop_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"{name} contains token ids {bad} outside the vocabulary; "
                    f"allowed range is [0, {vocab_size})"
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must satisfy {allowed}, got {name}={value!r}")


def _normalize_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"unknown stop type: stop={stop!r}; allowed: a str or a list of str")
    # An empty stop string would match at every position.
    if "" in stops:
        raise ValueError(f"stop must not contain empty strings, got stop={stop!r}")
    return list(stops)


def _normalize_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    # bool is an int subclass but never a meant token id.
    if isinstance(ids, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        return list(ids)
    raise ValueError(f"stop_token_ids must be a list of int, got stop_token_ids={ids!r}")
