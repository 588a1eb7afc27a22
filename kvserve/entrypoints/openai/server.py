"""`kvserve serve`: the FastAPI app and its uvicorn lifecycle (load, serve, drain on SIGTERM)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import time
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response

from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.kv_report import kv_cache_report
from kvserve.entrypoints.openai.api_key import has_bearer_key, missing_key_error
from kvserve.entrypoints.openai.dashboard import dashboard_router
from kvserve.entrypoints.openai.disconnect import cancel_on_disconnect
from kvserve.entrypoints.openai.errors import OpenAIError, install_error_handlers
from kvserve.entrypoints.openai.http_limits import RequestBodyLimits, header_timeout_protocol
from kvserve.entrypoints.openai.lora_modules import LoRAModule, UnknownAdapter
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest, TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from kvserve.entrypoints.openai.request_checks import warn_ignored_fields
from kvserve.entrypoints.openai.serving import ServerState, require_tokenizer
from kvserve.lora.adapter import LoRAError
from kvserve.entrypoints.openai.serving_chat import apply_chat_template, create_chat_completion
from kvserve.entrypoints.openai.serving_completion import create_completion

logger = logging.getLogger(__name__)

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def _served_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_SERVED_NAME
    base = os.path.basename(os.path.normpath(model))
    return base.removesuffix(".gguf")


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        # Load after the socket is up so /health can answer 503 while loading.
        loading = asyncio.create_task(state.load())
        yield
        loading.cancel()
        if state.async_llm is not None:
            await asyncio.to_thread(state.async_llm.shutdown)

    # With a key, the API description is served behind it too (routes below).
    open_docs = state.api_key is None
    app = FastAPI(title="kvserve", lifespan=lifespan, docs_url="/docs" if open_docs else None,
                  redoc_url="/redoc" if open_docs else None,
                  openapi_url="/openapi.json" if open_docs else None)
    install_error_handlers(app)
    app.add_middleware(RequestBodyLimits, max_body_size=state.max_body_size,
                       body_timeout=state.body_read_timeout)

    async def check_api_key(request: Request) -> None:
        if state.api_key is not None and not has_bearer_key(request, state.api_key):
            raise missing_key_error()

    api = APIRouter(dependencies=[Depends(check_api_key)])

    @app.get("/health")
    async def health() -> Response:
        if state.async_llm is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        dead = state.async_llm.engine.dead_reason()
        if dead is not None:
            return JSONResponse({"status": "dead", "reason": dead}, status_code=503)
        stalled = state.async_llm.stalled_for()
        if stalled > state.health_stall_timeout:
            return JSONResponse({"status": "stalled", "seconds_without_progress": round(stalled, 1)},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/debug/kv")
    async def debug_kv() -> JSONResponse:
        """The KV cache as of the last step: blocks, sharing, fragmentation, prefix hits."""
        engine = state.engine
        return JSONResponse(kv_cache_report(engine.stats(), engine.client.info))

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        engine = state.engine
        adapters = [{
            "id": name, "object": "model", "created": state.created, "owned_by": "kvserve",
            "root": module.path, "parent": module.base_model_name or state.served_model_name,
            "max_model_len": engine.max_model_len,
        } for name, module in state.lora.modules.items()]
        return JSONResponse({"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": state.created,
            "owned_by": "kvserve", "root": state.engine_args.model or DEFAULT_SERVED_NAME,
            "parent": None, "max_model_len": engine.max_model_len,
        }, *adapters]})

    def check_runtime_lora_updating() -> None:
        if not state.allow_runtime_lora_updating:
            raise OpenAIError(403, "loading and unloading LoRA adapters at runtime is off; start the server with "
                              "--allow-runtime-lora-updating", type="permission_error")

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        check_runtime_lora_updating()
        async_llm = state.engine and state.async_llm  # 503 while the model loads
        try:
            await state.load_lora(async_llm, LoRAModule(request.lora_name, request.lora_path))
        except LoRAError as error:  # the adapter cannot run on this model
            raise OpenAIError(400, str(error), param="lora_path") from None
        except ValueError as error:  # its name is taken
            raise OpenAIError(400, str(error), param="lora_name") from None
        return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", media_type="text/plain")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        check_runtime_lora_updating()
        engine = state.engine
        try:
            lora = state.lora.remove(request.lora_name)
        except UnknownAdapter:
            raise OpenAIError(404, f"The LoRA adapter `{request.lora_name}` does not exist.", param="lora_name",
                              code="model_not_found") from None
        running, waiting = engine.stats().lora_requests.get(lora.lora_name, (0, 0))
        await state.async_llm.remove_lora(lora.lora_int_id)
        message = f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        if running + waiting:
            message += (f" Its {running + waiting} running or waiting requests finish first on it; new requests "
                        "for it get 404.")
        return Response(message, media_type="text/plain")

    @api.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        warn_ignored_fields(request, "/v1/completions")
        return await cancel_on_disconnect(raw, create_completion(state, request))

    @api.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        warn_ignored_fields(request, "/v1/chat/completions")
        return await cancel_on_disconnect(raw, create_chat_completion(state, request))

    @api.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        warn_ignored_fields(request, "/tokenize")
        state.check_model(request.model)
        engine = state.engine
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
        if request.messages is not None:
            tokens = await state.off_loop(apply_chat_template, engine.tokenizer, request.messages,
                                          request.add_generation_prompt)
        else:
            tokenizer = require_tokenizer(engine, "tokenizing a prompt", "prompt")
            tokens = await state.off_loop(
                lambda: tokenizer(request.prompt, add_special_tokens=request.add_special_tokens).input_ids)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len})

    @api.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        warn_ignored_fields(request, "/detokenize")
        state.check_model(request.model)
        engine = state.engine
        vocab_size = engine.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                              param="tokens")
        tokenizer = require_tokenizer(engine, "detokenizing", "tokens")
        return JSONResponse({"prompt": await state.off_loop(tokenizer.decode, request.tokens)})

    if not open_docs:
        @api.get("/openapi.json", include_in_schema=False)
        async def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

        @api.get("/docs", include_in_schema=False)
        async def docs() -> Response:
            return get_swagger_ui_html(openapi_url="/openapi.json", title="kvserve")

        @api.get("/redoc", include_in_schema=False)
        async def redoc() -> Response:
            return get_redoc_html(openapi_url="/openapi.json", title="kvserve")

    app.include_router(api)
    if state.dashboard:
        app.include_router(dashboard_router(state))
    return app


class _DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT: answer 503 to new work, wait for in-flight requests (bounded), exit 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's own handler this does not re-raise the signal after shutdown,
        # so a drained server exits 0.
        if self.state.draining or self.state.async_llm is None or self._loop is None:
            self.should_exit = True  # a second signal, or nothing to drain: stop now
            self.force_exit = self.state.draining and sig == signal.SIGINT
            return
        logger.info("received %s: draining %d in-flight requests (up to %.0f s)",
                    signal.Signals(sig).name, self.state.num_in_flight, self.shutdown_timeout)
        self.state.draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.num_in_flight:
            logger.warning("shutdown timeout: aborting %d in-flight requests", self.state.num_in_flight)
            self.state.abort_in_flight()
            # Each handler now answers its error (a stream: error event and [DONE]).
            flush_deadline = time.monotonic() + 5
            while self.state.num_in_flight and time.monotonic() < flush_deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model starts loading: a port in use is an error
    at once, not after the load (uvicorn binds only after the app's startup, and its own
    Config.bind_socket exits the process instead of raising)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from error
    return sock


def run_server(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    state = ServerState(
        engine_args=engine_args,
        served_model_name=args.served_model_name or _served_name(engine_args.model),
        api_key=args.api_key or None,
        max_waiting_requests=args.max_waiting_requests,
        max_n=args.max_n,
        request_timeout=args.request_timeout,
        max_body_size=args.max_body_size,
        body_read_timeout=args.body_read_timeout,
        stream_interval=args.stream_interval,
        health_stall_timeout=args.health_stall_timeout,
        tool_call_parser=args.tool_call_parser,
        lora_modules=args.lora_modules,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        dashboard=args.dashboard,
    )
    if args.lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {args.stream_interval}")
    config = uvicorn.Config(
        build_app(state), host=args.host, port=args.port, log_level=args.log_level.lower(),
        http=header_timeout_protocol(args.header_read_timeout),
        # Drained requests have finished by now; this only bounds flushing the last bytes.
        timeout_graceful_shutdown=1,
    )
    sock = _listening_socket(args.host, args.port)
    server = _DrainingServer(config, state, args.shutdown_timeout)
    state.request_exit = lambda: setattr(server, "should_exit", True)
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    logger.info("kvserve listening on %s (loading the model)%s", url,
                f"; live dashboard at {url}/dashboard" if args.dashboard else "")
    server.run(sockets=[sock])
    return 1 if state.load_error is not None else 0
