"""Request bodies of the OpenAI API (pydantic), plus vLLM's extra sampling fields.

Unknown fields are kept aside (`model_extra`) and ignored with a logged warning, as vLLM
does: load tools and SDKs send vendor extensions freely. Fields whose silent omission would
change what a client gets (the deprecated functions, best_of) are declared so that they can
be refused instead (request_checks.py). Integers carry the ranges they are meaningful in;
Infinity and NaN, which the JSON parser accepts, are never a valid number. Responses are
plain dicts built in the serving modules, in the exact OpenAI shapes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvserve.sampling_params import INT64_MAX, SEED_MAX, SEED_MIN

TokenIds = list[StrictInt]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far (guidellm counts tokens with it).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    # Aliased: `schema` would shadow a pydantic method.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (None: the default)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(default=None, ge=1, le=INT64_MAX)  # at most --max-n: request_checks.py
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extras, named as in vLLM.
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    priority: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    # OpenAI's structured output, and vLLM's extra (json, json_object, regex, choice, grammar).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(default=16, le=INT64_MAX)  # 16: the OpenAI default
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str = Field(min_length=1)  # data:image/...;base64,..., file://... or http(s)://...
    detail: str | None = None  # OpenAI's; the model's own image processor decides


class ImageUrlContentPart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextContentPart | ImageUrlContentPart, Field(discriminator="type")]


class FunctionCall(_Body):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCallMessage(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # max_tokens is deprecated by OpenAI in favour of max_completion_tokens.
    max_tokens: int | None = Field(default=None, le=INT64_MAX)
    max_completion_tokens: int | None = Field(default=None, le=INT64_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none", "auto", "required": tools.py
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds


class LoadLoRAAdapterRequest(_Body):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str
    lora_path: str | None = None  # accepted as vLLM's clients send it; the name decides
