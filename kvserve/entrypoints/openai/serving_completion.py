"""POST /v1/completions: text completions, streamed or not, in OpenAI's legacy shape."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.entrypoints.openai.errors import OpenAIError
from kvserve.entrypoints.openai.protocol import CompletionRequest
from kvserve.entrypoints.openai.request_checks import check_completion_request, check_sampling_request
from kvserve.entrypoints.openai.serving import (
    ServerState, StreamThrottle, chunk_usage, collect_final, generate_all, sampling_params,
    sse_stream, require_tokenizer, token_text, top_entries, usage, validate_prompt,
)
from kvserve.outputs import RequestOutput


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
    return [prompt] if isinstance(prompt[0], int) else list(prompt)


class _LogprobsBuilder:
    """The completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tokenizer, num_top: int) -> None:
        self._tokenizer = tokenizer
        self._num_top = num_top

    def build(self, token_ids: list[int], entries: list[dict[int, float] | None],
              offset: int) -> dict:
        result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                   "text_offset": []}
        for token_id, entry in zip(token_ids, entries):
            text = token_text(self._tokenizer, token_id)
            result["tokens"].append(text)
            result["text_offset"].append(offset)
            offset += len(text)
            if entry is None:  # the first prompt token has no context
                result["token_logprobs"].append(None)
                result["top_logprobs"].append(None)
            else:
                result["token_logprobs"].append(entry[token_id])
                result["top_logprobs"].append({
                    token_text(self._tokenizer, t): lp for t, lp in top_entries(entry, self._num_top)
                })
        return result


async def create_completion(state: ServerState, request: CompletionRequest) -> JSONResponse | StreamingResponse:
    lora = state.check_model(request.model)
    check_sampling_request(request, state.max_n, state.engine_args.max_num_seqs)
    check_completion_request(request)
    engine = state.engine
    num_logprobs = request.logprobs
    echo = bool(request.echo)
    params = sampling_params(
        request, engine.sampling_defaults, max_tokens=request.max_tokens, logprobs=num_logprobs,
        prompt_logprobs=num_logprobs if echo else None,
    )
    prompts = _prompt_list(request.prompt)
    token_lists = [await state.off_loop(validate_prompt, engine, prompt, params) for prompt in prompts]
    # Echo repeats the prompt as sent; token-id prompts are shown decoded.
    prompt_texts = [p if isinstance(p, str) else await state.off_loop(
        require_tokenizer(engine, "echo of token ids", "echo").decode, p) for p in prompts] if echo else []
    state.admit(len(token_lists))
    logprobs = _LogprobsBuilder(engine.tokenizer, num_logprobs) if num_logprobs is not None else None
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    n = params.n
    priority = request.priority or 0

    def chunk_base() -> dict:
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": state.served_model_name if lora is None else lora.lora_name}

    if not request.stream:
        finals = await collect_final(state, request_id, token_lists, params, priority, lora)
        choices = []
        for index, final in enumerate(finals):
            for completion in final.outputs:
                prefix = prompt_texts[index] if echo else ""
                choice_logprobs = None
                if logprobs is not None:
                    ids, entries = list(completion.token_ids), list(completion.logprobs or [])
                    if echo:
                        ids, entries = final.prompt_token_ids + ids, list(final.prompt_logprobs or []) + entries
                    choice_logprobs = logprobs.build(ids, entries, 0)
                choices.append({"index": index * n + completion.index, "text": prefix + completion.text,
                                "logprobs": choice_logprobs, "finish_reason": completion.finish_reason})
        choices.sort(key=lambda c: c["index"])
        return JSONResponse({**chunk_base(), "choices": choices, "usage": usage(token_lists, finals)})

    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    finals: list[RequestOutput | None] = [None] * len(token_lists)

    async def chunks() -> AsyncIterator[dict]:
        throttle = StreamThrottle(state.stream_interval)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        async for index, output in generate_all(state, request_id, token_lists, params, priority, lora):
            finals[index] = output
            for completion in output.outputs:
                choice = index * n + completion.index
                finished = completion.finish_reason is not None
                text = completion.text[sent_text.get(choice, 0):]
                if not text and not finished:
                    continue  # tokens whose text is held back (stop-string prefix, partial UTF-8)
                if not throttle.due(choice, len(completion.token_ids), finished):
                    continue
                first = choice not in sent_text
                ids = completion.token_ids[sent_tokens.get(choice, 0):]
                entries = (completion.logprobs or [])[sent_tokens.get(choice, 0):]
                if first and echo:
                    text = prompt_texts[index] + text
                    ids = output.prompt_token_ids + ids
                    entries = list(output.prompt_logprobs or []) + entries
                choice_logprobs = None
                if logprobs is not None:
                    choice_logprobs = logprobs.build(ids, entries, offsets.get(choice, 0))
                    offsets[choice] = offsets.get(choice, 0) + sum(len(t) for t in choice_logprobs["tokens"])
                sent_text[choice] = len(completion.text)
                sent_tokens[choice] = len(completion.token_ids)
                yield {**chunk_base(), "choices": [{
                    "index": choice, "text": text, "logprobs": choice_logprobs,
                    "finish_reason": completion.finish_reason,
                }], **chunk_usage(request.stream_options, token_lists, finals)}

    def usage_chunk() -> dict | None:
        if not include_usage:
            return None
        return {**chunk_base(), "choices": [], "usage": usage(token_lists, finals)}

    return StreamingResponse(sse_stream(state, chunks(), usage_chunk), media_type="text/event-stream")
