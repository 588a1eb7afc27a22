"""Request bodies of the OpenAI API (pydantic), plus vLLM's extra sampling fields.

Unknown fields are rejected (400 naming them) rather than silently ignored, so a client
never believes a parameter took effect when it did not. Responses are plain dicts built
in the serving modules, in the exact OpenAI shapes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

TokenIds = list[StrictInt]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (None: the default)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extras, named as in vLLM.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    priority: int | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16  # the OpenAI default for completions
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds
