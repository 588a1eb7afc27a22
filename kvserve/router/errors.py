"""OpenAI-shaped error responses the router itself produces: the server's OpenAIError defined
again, since the router imports nothing of kvserve but itself (it talks HTTP to its workers)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class RouterError(Exception):
    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
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
