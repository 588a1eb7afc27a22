"""What a request body's schema cannot say: limits that are server settings, fields that
only make sense together, declared fields this server refuses, and the unknown fields it
ignores (logged, as vLLM does)."""

from __future__ import annotations

import logging

from pydantic import BaseModel

from kvserve.entrypoints.openai.errors import OpenAIError
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

logger = logging.getLogger(__name__)

# Unknown field names listed in one warning, so a hostile body cannot flood the log.
_MAX_LOGGED_FIELDS = 10


def ignored_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the unknown fields anywhere in a parsed body."""
    names = [prefix + name for name in body.model_extra or {}]
    for name in type(body).model_fields:
        value = getattr(body, name)
        children = value if isinstance(value, list) else [value]
        for index, child in enumerate(children):
            if isinstance(child, BaseModel):
                where = f"{name}.{index}." if isinstance(value, list) else f"{name}."
                names += ignored_fields(child, prefix + where)
    return names


def warn_ignored_fields(body: BaseModel, endpoint: str) -> None:
    names = ignored_fields(body)
    if names:
        more = f" and {len(names) - _MAX_LOGGED_FIELDS} more" if len(names) > _MAX_LOGGED_FIELDS else ""
        logger.warning("%s: ignored unknown fields %s%s", endpoint,
                       ", ".join(names[:_MAX_LOGGED_FIELDS]), more)


def check_sampling_request(request: SamplingRequest, max_n: int, max_num_seqs: int) -> None:
    if request.stream_options is not None and not request.stream:
        raise OpenAIError(400, "stream_options is only allowed when stream is true",
                          param="stream_options")
    n = request.n or 1
    # All n samples of a prompt run side by side once its prefill ends.
    limit = min(max_n, max_num_seqs)
    if n > limit:
        which = "--max-n" if max_n <= max_num_seqs else "--max-num-seqs, the most sequences a step runs"
        raise OpenAIError(400, f"n must be at most {limit} ({which}), got n={n}", param="n")


def check_completion_request(request: CompletionRequest) -> None:
    if request.suffix is not None:
        raise OpenAIError(400, "suffix is not supported by this server", param="suffix")
    # best_of > n would pick the best of extra samples, which this server does not draw.
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise OpenAIError(400, f"best_of must equal n ({request.n or 1}) on this server, got "
                          f"best_of={request.best_of}", param="best_of")


def check_chat_request(request: ChatCompletionRequest) -> None:
    """The deprecated `functions` / `function_call` are not implemented (`tools` are):
    answering as if they had not been asked for would hand the client text it did not ask for."""
    if request.functions:
        raise OpenAIError(400, "functions is not supported by this server; use tools",
                          param="functions")
    if request.function_call not in (None, "none"):
        raise OpenAIError(400, "function_call is not supported by this server; use tool_choice",
                          param="function_call")
