"""The router's HTTP front: the OpenAI API of `kvserve serve`, answered by its workers."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.router.admission import AdmissionQueue, ClientGone, RateLimiter, request_tokens
from kvserve.router.errors import RouterError
from kvserve.router.health import HealthChecker
from kvserve.router.metrics import RouterMetrics
from kvserve.router.proxy import Forwarder
from kvserve.router.routing_key import routing_key
from kvserve.router.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

# Paths routed by the body's model; /tokenize and /detokenize too, which `kvserve bench serve`
# uses to size its prompts.
_ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@dataclass
class RouterState:
    pool: WorkerPool
    metrics: RouterMetrics
    client: httpx.AsyncClient
    health: HealthChecker
    forwarder: Forwarder
    admission: AdmissionQueue
    rate_limiter: RateLimiter | None
    token_rate_limiter: RateLimiter | None
    draining: bool = False
    tasks: list[asyncio.Task] = field(default_factory=list)


def _resolve_model(state: RouterState, body: dict) -> str:
    models = state.pool.models()
    model = body.get("model")
    if model is None:
        if len(models) == 1:
            return models[0]
        raise RouterError(400, f"'model' is required: this router serves {', '.join(models) or 'no model yet'}",
                          param="model")
    if not isinstance(model, str) or model not in models:
        raise RouterError(404, f"The model `{model}` does not exist. Available models: "
                          f"{', '.join(models) or 'none (no worker has answered yet)'}",
                          type="NotFoundError", param="model", code="model_not_found")
    return model


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read: the next ASGI message is the client going away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(state: RouterState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.health.check_due()  # the first round before the first request
        state.tasks.append(asyncio.create_task(state.health.run()))
        yield
        for task in state.tasks:
            task.cancel()
        await state.client.aclose()

    app = FastAPI(title="kvserve router", lifespan=lifespan)

    @app.exception_handler(RouterError)
    async def router_error(request: Request, error: RouterError) -> JSONResponse:
        state.metrics.rejected.labels(error.code or str(error.status_code)).inc()
        return error.response()

    async def routed(request: Request) -> Response:
        if state.draining:
            raise RouterError(503, "the router is shutting down", type="service_unavailable")
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as error:
            raise RouterError(400, f"the body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise RouterError(400, "the body must be a JSON object")
        model = _resolve_model(state, body)
        api_key = request.headers.get("authorization", "")
        if state.rate_limiter is not None:
            state.rate_limiter.check(api_key)
        if state.token_rate_limiter is not None:
            state.token_rate_limiter.check(api_key, request_tokens(body))
        # Passed through in the body: the worker schedules by it too.
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RouterError(400, "priority must be an integer", param="priority")
        wait_disconnect = lambda: _wait_for_disconnect(request)
        try:
            await state.admission.admit(model, priority, wait_disconnect)
        except ClientGone:
            return Response(status_code=499)
        return await state.forwarder.forward(
            request.url.path, model, raw, routing_key(body), dict(request.headers),
            wait_disconnect, lambda worker: state.admission.wake())

    for path in _ROUTED_PATHS:
        app.add_api_route(path, routed, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = []
        for model in state.pool.models():
            workers = [w for w in state.pool.workers if model in w.models]
            data.append({"id": model, "object": "model", "owned_by": "kvserve",
                         "workers": len(workers), "healthy_workers": sum(w.healthy for w in workers)})
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = [w.url for w in state.pool.workers if w.healthy]
        if state.draining or not healthy:
            reason = "draining" if state.draining else "no healthy worker"
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ok", "healthy_workers": len(healthy),
                             "workers": len(state.pool.workers)})

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse({"workers": [_describe(w) for w in state.pool.workers]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _describe(worker: Worker) -> dict:
    return {"url": worker.url, "healthy": worker.healthy, "models": sorted(worker.models),
            "outstanding": worker.outstanding, "last_error": worker.last_error}
