"""POST /v1/chat/completions: the model's chat template, then generation in OpenAI's chat
shape, with tool calls (tools.py) when the request has tools."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError

from PIL import Image

from kvserve.engine.input_processor import NO_TOKENIZER, PreparedPrompt
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.openai.errors import OpenAIError
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, Tool
from kvserve.entrypoints.openai.request_checks import check_chat_request, check_sampling_request
from kvserve.entrypoints.openai.serving import (
    ServerState, StreamThrottle, chunk_usage, collect_final, generate_all, sampling_params,
    sse_stream, token_text, top_entries, usage, validate_prompt,
)
from kvserve.entrypoints.openai.structured import structured_outputs
from kvserve.entrypoints.openai.tool_stream import ToolCallDeltas
from kvserve.entrypoints.openai.tools import (
    conversation, parse_output, tool_call_json, tool_constraint, tool_mode,
)
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams


def apply_chat_template(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                        tools: list[Tool] | None = None) -> list[int]:
    if tokenizer is None:
        raise OpenAIError(400, f"{NO_TOKENIZER}: chat needs one (its template and the message text)",
                          param="messages")
    if not tokenizer.chat_template:
        raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages")
    # A template that never mentions tools would drop them (and tool calls) silently.
    takes_tools = "tools" in str(tokenizer.chat_template)
    extra = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools and takes_tools else {}
    try:
        return list(tokenizer.apply_chat_template(
            conversation(messages, tools, takes_tools), add_generation_prompt=add_generation_prompt,
            tokenize=True, return_dict=True, **extra)["input_ids"])
    except ValueError as error:
        raise OpenAIError(400, str(error), param="messages") from None
    except TemplateError as error:
        raise OpenAIError(400, f"the chat template rejected the messages: {error}", param="messages") from None


def _split_images(engine: LLMEngine, messages: list[ChatMessage]) -> tuple[list[ChatMessage], list[Image.Image]]:
    """Messages whose image parts became the model's placeholder text, and the images
    (loaded under the server's media policy; every problem a 400)."""
    if not any(isinstance(m.content, list) and any(p.type == "image_url" for p in m.content) for m in messages):
        return messages, []
    raw = [{"content": [p.model_dump() for p in m.content] if isinstance(m.content, list) else m.content}
           for m in messages]
    try:
        converted, images = engine.split_chat_images(raw)
    except ValueError as error:
        raise OpenAIError(400, str(error), param="messages") from None
    return [m.model_copy(update={"content": c["content"]}) for m, c in zip(messages, converted)], images


def _chat_prompt(engine: LLMEngine, messages: list[ChatMessage], params: SamplingParams,
                 tools: list[Tool] | None) -> PreparedPrompt:
    """The prompt, its images preprocessed and placeholders expanded, checked to fit."""
    messages, images = _split_images(engine, messages)
    prompt: dict = {"prompt_token_ids": apply_chat_template(engine.tokenizer, messages, tools=tools)}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    try:
        prepared = engine.prepare_prompt(prompt)
    except ValueError as error:
        raise OpenAIError(400, str(error), param="messages") from None
    validate_prompt(engine, prepared.token_ids, params)
    return prepared


def _logprobs(tokenizer, completion: CompletionOutput, start: int, num_top: int) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        {**entry(token_id, lps[token_id]),
         "top_logprobs": [entry(t, lp) for t, lp in top_entries(lps, num_top)]}
        for token_id, lps in zip(completion.token_ids[start:], (completion.logprobs or [])[start:])
    ]
    return {"content": content, "refusal": None}


async def create_chat_completion(state: ServerState, request: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
    lora = state.check_model(request.model)
    check_sampling_request(request, state.max_n, state.engine_args.max_num_seqs)
    check_chat_request(request)
    engine = state.engine
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    num_top = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    mode = tool_mode(request, state.tool_call_parser)
    tool_constrained = tool_constraint(request, mode)
    if tool_constrained is not None and structured_outputs(request) is not None:
        raise OpenAIError(400, f"tool_choice {request.tool_choice if mode == 'required' else 'naming a function'} "
                          "constrains the output; it cannot be combined with response_format or "
                          "structured_outputs", param="tool_choice")
    overrides = {} if tool_constrained is None else {"structured_outputs": tool_constrained}
    params = sampling_params(request, engine.sampling_defaults, max_tokens=max_tokens, logprobs=num_top,
                             **overrides)
    tools = request.tools if mode != "none" else None
    prepared = await state.off_loop(_chat_prompt, engine, request.messages, params, tools)
    prompt_ids = prepared.token_ids
    state.admit(1)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    priority = request.priority or 0

    def base(kind: str) -> dict:
        model = state.served_model_name if lora is None else lora.lora_name
        return {"id": request_id, "object": kind, "created": created, "model": model}

    if not request.stream:
        (final,) = await collect_final(state, request_id, [prepared], params, priority, lora)
        choices = []
        for c in final.outputs:
            message: dict = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            parsed = parse_output(c.text, request, mode, state.tool_call_parser)
            if parsed.tool_calls:
                message = {"role": "assistant", "content": parsed.content,
                           "tool_calls": [tool_call_json(call) for call in parsed.tool_calls]}
                finish_reason = "tool_calls"
            choices.append({
                "index": c.index, "message": message,
                "logprobs": _logprobs(engine.tokenizer, c, 0, num_top) if num_top is not None else None,
                "finish_reason": finish_reason,
            })
        return JSONResponse({**base("chat.completion"), "choices": choices,
                             "usage": usage([prompt_ids], [final])})

    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    last: list[RequestOutput | None] = [None]

    def chunk(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {**base("chat.completion.chunk"), "choices": [{
            "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
        }], **chunk_usage(request.stream_options, [prompt_ids], last)}

    async def chunks() -> AsyncIterator[dict]:
        for index in range(params.n):
            yield chunk(index, {"role": "assistant", "content": ""}, None, None)
        throttle = StreamThrottle(state.stream_interval)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        tool_deltas = {index: ToolCallDeltas(request, mode, state.tool_call_parser)
                       for index in range(params.n)} if mode != "none" else {}
        async for _, output in generate_all(state, request_id, [prepared], params, priority, lora):
            last[0] = output
            for c in output.outputs:
                finished = c.finish_reason is not None
                text = c.text[sent_text.get(c.index, 0):]
                if not text and not finished:
                    continue
                if not throttle.due(c.index, len(c.token_ids), finished):
                    continue
                deltas = ([{"content": text}] if text else []) if not tool_deltas else (
                    tool_deltas[c.index].update(c.text, finished))
                if text:
                    logprobs = (_logprobs(engine.tokenizer, c, sent_tokens.get(c.index, 0), num_top)
                                if num_top is not None else None)
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    for delta in deltas:
                        yield chunk(c.index, delta, logprobs, None)
                        logprobs = None
                elif deltas:  # tool calls parsed at the end
                    for delta in deltas:
                        yield chunk(c.index, delta, None, None)
                if finished:
                    # Tokens without text of their own (EOS) still get their logprobs.
                    rest = sent_tokens.get(c.index, 0)
                    logprobs = (_logprobs(engine.tokenizer, c, rest, num_top)
                                if num_top is not None and len(c.token_ids) > rest else None)
                    called = c.index in tool_deltas and tool_deltas[c.index].num_calls
                    yield chunk(c.index, {}, logprobs, "tool_calls" if called else c.finish_reason)

    def usage_chunk() -> dict | None:
        if not include_usage:
            return None
        return {**base("chat.completion.chunk"), "choices": [], "usage": usage([prompt_ids], [last[0]])}

    return StreamingResponse(sse_stream(state, chunks(), usage_chunk), media_type="text/event-stream")
