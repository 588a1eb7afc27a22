"""OpenAI error JSON for every failure: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# The prefix of input_processor.context_length_error's message (OpenAI's wording).
_CONTEXT_LENGTH_PREFIX = "This model's maximum context length is"
# Validation problems spelled out in one message; a body with a million bad token ids
# would otherwise get a response as large as itself.
_MAX_LISTED_PROBLEMS = 5


class OpenAIError(Exception):
    def __init__(
        self, status_code: int, message: str, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(error: ValueError, known_params: frozenset[str] = frozenset()) -> OpenAIError:
    """A 400 from an engine / SamplingParams ValueError, naming the parameter when it can."""
    message = str(error)
    if message.startswith(_CONTEXT_LENGTH_PREFIX):
        return OpenAIError(400, message, param="input_tokens", code="context_length_exceeded")
    # SamplingParams and LLMEngine.validate messages name the parameter near the start
    # ("top_p must satisfy ...", "prompt (N tokens) plus max_tokens (M) needs ...").
    words = [w.strip(":=,'") for w in message.split()[:6]]
    param = next((w for w in words if w in known_params), None)
    return OpenAIError(400, message, param=param)


def _field_name(location: tuple) -> str | None:
    parts = [str(part) for part in location if part != "body"]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI clients expect 400 naming the offending field.
        first = error.errors()[0]
        if first.get("type") == "json_invalid":
            message = f"Malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}"
            return OpenAIError(400, message).response()
        field = _field_name(tuple(first.get("loc", ())))
        errors = error.errors()
        problems = "; ".join(
            f"{_field_name(tuple(e.get('loc', ()))) or 'body'}: {e['msg']}"
            + (f" (got {json.dumps(e['input'], default=str)[:100]})" if "input" in e and e["type"] != "missing" else "")
            for e in errors[:_MAX_LISTED_PROBLEMS]
        )
        if len(errors) > _MAX_LISTED_PROBLEMS:
            problems += f"; and {len(errors) - _MAX_LISTED_PROBLEMS} more"
        return OpenAIError(400, f"Invalid request: {problems}", param=field).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return OpenAIError(error.status_code, str(error.detail), param=None, code=code).response()

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected server error")
        return OpenAIError(500, f"internal server error: {error!r}", type="internal_server_error").response()
