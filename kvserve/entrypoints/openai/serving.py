"""What both generation endpoints share: server state, admission, sampling params,
running engine requests (merged, metered, aborted on disconnect) and SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from functools import partial
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.input_processor import NO_TOKENIZER, PreparedPrompt
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.openai.errors import OpenAIError, bad_request
from kvserve.entrypoints.openai.lora_modules import LoRAModule, LoRARegistry
from kvserve.entrypoints.openai.protocol import SamplingRequest, StreamOptions
from kvserve.entrypoints.openai.structured import structured_outputs
from kvserve.lora.request import LoRARequest
from kvserve.metrics import ServerMetrics
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams)) | {"input_tokens"}
# OpenAI's documented logit_bias range; vLLM clamps to it too.
_MAX_LOGIT_BIAS = 100.0
# What a 429 tells a client to wait before retrying, in seconds.
RETRY_AFTER_S = 1

T = TypeVar("T")


# Put into a generation's output queue when the server stops waiting for it at shutdown.
SHUTDOWN = object()


@dataclass
class ServerState:
    engine_args: EngineArgs
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_n: int = 128
    request_timeout: float | None = None
    max_body_size: int = 16 * 2**20
    body_read_timeout: float = 60.0
    stream_interval: int = 1
    health_stall_timeout: float = 300.0
    tool_call_parser: str | None = None  # --tool-call-parser: reads "auto" tool calls
    lora_modules: list[LoRAModule] = field(default_factory=list)  # --lora-modules, loaded at start
    allow_runtime_lora_updating: bool = False
    dashboard: bool = True  # /dashboard and its event stream (--no-dashboard: off)
    async_llm: AsyncLLM | None = None
    draining: bool = False
    load_error: BaseException | None = None
    # Generation requests between admission and their last byte; SIGTERM waits for 0.
    num_in_flight: int = 0
    # Each running generation's output queue: past --shutdown-timeout, SIGTERM ends them all
    # with an error (a stream gets its error event and [DONE]) instead of cutting connections.
    output_queues: set[asyncio.Queue] = field(default_factory=set)
    # Engine requests admitted here that have no output yet: the engine's own waiting count
    # lags while their add commands sit in its queue, so a burst would all pass admit().
    num_not_started: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(init=False)
    lora: LoRARegistry = field(init=False)
    # Set by run_server: asks uvicorn to stop (used when loading the model fails).
    request_exit: Callable[[], None] = lambda: None

    def abort_in_flight(self) -> None:
        for queue in self.output_queues:
            queue.put_nowait(SHUTDOWN)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.served_model_name)
        self.lora = LoRARegistry(self.served_model_name)
        # Tokenizing a long prompt takes seconds: off the event loop, one at a time (a fast
        # tokenizer is not safe to use from several threads at once).
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")

    async def off_loop(self, function: Callable[..., T], *args: object) -> T:
        """Runs tokenizer work (tokenize, chat template, decode) on the tokenizer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, partial(function, *args))

    @property
    def ready(self) -> bool:
        return self.async_llm is not None and not self.draining

    @property
    def engine(self) -> LLMEngine:
        if self.async_llm is None:
            raise OpenAIError(503, "the model is still loading; retry shortly",
                              type="service_unavailable")
        return self.async_llm.engine

    async def load(self) -> None:
        async_llm = AsyncLLM.from_engine_args(self.engine_args)
        try:
            engine = await async_llm.started()
            for module in self.lora_modules:
                await self.load_lora(async_llm, module)
        except Exception as error:
            logger.error("failed to load the model: %s", error)
            self.load_error = error
            self.request_exit()
            return
        self.metrics.attach_engine(engine)
        self.async_llm = async_llm
        info = engine.client.info
        num_blocks, block_size = info.num_blocks, info.block_size
        logger.info(
            "serving %s as %r: dtype=%s device=%s, %d KV blocks x %d tokens = %d max "
            "concurrent tokens, max_model_len=%d",
            self.engine_args.model or "the embedded SmolLM2-135M-Instruct GGUF",
            self.served_model_name,
            str(self.engine_args.resolved_dtype(engine.device)).removeprefix("torch."),
            engine.device, num_blocks, block_size, num_blocks * block_size,
            engine.max_model_len,
        )

    async def load_lora(self, async_llm: AsyncLLM, module: LoRAModule) -> LoRARequest:
        """Read, check and register an adapter (ValueError / LoRAError when it cannot run)."""
        request = self.lora.new_request(module)
        await async_llm.add_lora(request)
        self.lora.add(module, request)
        logger.info("LoRA adapter %r loaded from %s (id %d)", module.name, module.path, request.lora_int_id)
        return request

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a
        name that is neither."""
        if model is None or model == self.served_model_name:
            return None
        lora = self.lora.requests.get(model)
        if lora is None:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model",
                              code="model_not_found")
        return lora

    def admit(self, num_requests: int) -> None:
        """Refuse new work while loading, draining, or with a full waiting queue."""
        if self.draining:
            raise OpenAIError(503, "the server is shutting down", type="service_unavailable")
        engine = self.engine
        dead = engine.dead_reason()
        if dead is not None:
            raise OpenAIError(503, f"the engine cannot serve: {dead}", type="service_unavailable")
        limit = self.max_waiting_requests
        waiting = max(engine.num_requests_waiting, self.num_not_started)
        if limit is not None and waiting + num_requests > limit:
            raise OpenAIError(
                429, f"the waiting queue is full ({waiting} waiting, limit {limit}); retry "
                f"in {RETRY_AFTER_S} s", type="rate_limit_error", code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)})


def sampling_params(request: SamplingRequest, defaults: dict[str, float], **overrides: object) -> SamplingParams:
    """SamplingParams from the request's non-null fields, else the model's `defaults`
    (LLMEngine.sampling_defaults), and its output constraint; a bad value is a 400 naming it."""
    values = defaults | {
        name: getattr(request, name)
        for name in ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "stop",
                     "ignore_eos", "min_tokens")
        if getattr(request, name) is not None
    }
    if values.get("top_k") == 0:  # vLLM's API reads 0 as "disabled", like -1
        values["top_k"] = -1
    if request.logit_bias:
        values["logit_bias"] = {token: min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, bias))
                                for token, bias in request.logit_bias.items()}
    if "structured_outputs" not in overrides:  # tool_choice's constraint, when it has one
        overrides["structured_outputs"] = structured_outputs(request)
    try:
        return SamplingParams(**values, **overrides)
    except ValueError as error:
        raise bad_request(error, _SAMPLING_FIELDS) from None


def validate_prompt(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> list[int]:
    """Token ids of a prompt that fits; raises a 400 before anything is scheduled. Runs on
    the tokenizer thread (ServerState.off_loop)."""
    try:
        _, token_ids = engine.tokenize_prompt(prompt)
        max_tokens = engine.validate(token_ids, params)
    except ValueError as error:
        raise bad_request(error, _SAMPLING_FIELDS) from None
    if params.min_tokens > max_tokens:
        raise OpenAIError(400, f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens "
                          "this request may generate", param="min_tokens")
    return token_ids


async def generate_all(
    state: ServerState, request_id: str, prompts: list[list[int]] | list[PreparedPrompt], params: SamplingParams,
    priority: int, lora_request: LoRARequest | None = None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Runs every prompt (token ids, or prepared with its images) as its own engine request;
    yields (prompt index, output) as they come.

    Leaving early (client disconnect, error, --request-timeout) cancels the consumers, which
    aborts the engine requests and frees their KV blocks.
    """
    async_llm = state.async_llm
    merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    # Counted from here, not from inside the consumer tasks, so that a burst admitted in the
    # same loop iteration sees it (ServerState.admit).
    not_started = set(range(len(prompts)))
    state.num_not_started += len(prompts)

    def mark_started(index: int) -> None:
        if index in not_started:
            not_started.discard(index)
            state.num_not_started -= 1

    async def consume(index: int, prompt: list[int] | PreparedPrompt) -> None:
        prepared = prompt if isinstance(prompt, PreparedPrompt) else PreparedPrompt(None, prompt)
        tracker = state.metrics.track(len(prepared.token_ids), len(prepared.mm_features))
        try:
            async for output in async_llm.generate(
                prepared, params, request_id=f"{request_id}-{index}",
                priority=priority, lora_request=lora_request,
            ):
                mark_started(index)
                tracker.on_output(output)
                merged.put_nowait((index, output))
            merged.put_nowait(None)
        except Exception as error:
            merged.put_nowait(error)
        finally:
            tracker.finish()

    # The deadline guards only the waits: a timeout scope spanning a `yield` would cancel
    # whatever the consumer awaits at that moment.
    timeout = state.request_timeout
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    tasks = [asyncio.create_task(consume(i, ids)) for i, ids in enumerate(prompts)]
    state.output_queues.add(merged)
    try:
        remaining = len(tasks)
        while remaining:
            try:
                async with asyncio.timeout_at(deadline):
                    item = await merged.get()
            except TimeoutError:
                raise OpenAIError(
                    504, f"the request did not finish within --request-timeout ({timeout:g} s) "
                    "and was aborted", type="timeout_error",
                    code="request_timeout") from None
            if item is None:
                remaining -= 1
            elif item is SHUTDOWN:
                raise OpenAIError(503, "the server shut down before the request finished "
                                  "(--shutdown-timeout)", type="service_unavailable", code="server_shutdown")
            elif isinstance(item, BaseException):
                raise OpenAIError(500, f"generation failed: {item}", type="internal_server_error")
            else:
                yield item
    finally:
        state.output_queues.discard(merged)
        for index in list(not_started):
            mark_started(index)
        for task in tasks:
            task.cancel()


async def collect_final(
    state: ServerState, request_id: str, prompts: list[list[int]] | list[PreparedPrompt], params: SamplingParams,
    priority: int, lora_request: LoRARequest | None = None,
) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(prompts)
    state.num_in_flight += 1
    try:
        async for index, output in generate_all(state, request_id, prompts, params, priority, lora_request):
            finals[index] = output
    finally:
        state.num_in_flight -= 1
    return finals  # type: ignore[return-value]


def top_entries(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of a sampler logprob entry (it lists them best first,
    then the sampled token if it was not among them)."""
    return list(entry.items())[:k]


def token_text(tokenizer, token_id: int) -> str:
    """One token's own text, for logprob listings (the generated text comes from the engine);
    without a tokenizer "token_id:<id>", as vLLM writes token ids in place of text."""
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])


def require_tokenizer(engine: LLMEngine, needs: str, param: str) -> PreTrainedTokenizerBase:
    """The engine's tokenizer, or a 400 naming what needed one (skip_tokenizer_init, dummy weights)."""
    if engine.tokenizer is None:
        raise OpenAIError(400, f"{NO_TOKENIZER}: {needs} needs one", param=param)
    return engine.tokenizer


def usage(prompts: list[list[int]], outputs: list[RequestOutput | None]) -> dict[str, int]:
    """Token counts; `outputs` are the latest of each prompt, None before its first."""
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(c.token_ids) for out in outputs if out is not None for c in out.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chunk_usage(options: StreamOptions | None, prompts: list[list[int]],
                outputs: list[RequestOutput | None]) -> dict:
    """The `usage` field of a content chunk: absent without include_usage, null with it, and
    the counts so far with vLLM's continuous_usage_stats."""
    if options is None or not options.include_usage:
        return {}
    return {"usage": usage(prompts, outputs) if options.continuous_usage_stats else None}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def sse_stream(
    state: ServerState, chunks: AsyncIterator[dict], include_usage: Callable[[], dict | None],
) -> AsyncIterator[str]:
    """Frames chunks as SSE, adds the usage chunk and [DONE]; an engine failure mid-stream
    becomes an error event (the status line has already gone out)."""
    state.num_in_flight += 1
    try:
        async for chunk in chunks:
            yield sse(chunk)
        final = include_usage()
        if final is not None:
            yield sse(final)
    except OpenAIError as error:
        yield sse(error.body())
    finally:
        state.num_in_flight -= 1
    yield sse("[DONE]")


class StreamThrottle:
    """--stream-interval: send a choice's update only every N new tokens (first and last always)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._sent_tokens: dict[int, int] = {}

    def due(self, choice: int, num_tokens: int, finished: bool) -> bool:
        sent = self._sent_tokens.get(choice)
        if finished or sent is None or num_tokens - sent >= self.interval:
            self._sent_tokens[choice] = num_tokens
            return True
        return False
