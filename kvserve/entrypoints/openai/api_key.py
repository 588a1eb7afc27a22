"""The server's --api-key: requests send 'Authorization: Bearer KEY'. The dashboard's page
may send it as a cookie instead, since a browser sets no header on opening a page or on an
EventSource; the page's own key form sets that cookie, so the key never rides in a URL
(and an access log)."""

from __future__ import annotations

import hmac
from urllib.parse import unquote

from fastapi import Request

from kvserve.entrypoints.openai.errors import OpenAIError

KEY_COOKIE = "kvserve_api_key"


def _same(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode(), expected.encode())  # in constant time


def has_bearer_key(request: Request, api_key: str) -> bool:
    return _same(request.headers.get("authorization", ""), f"Bearer {api_key}")


def has_key_cookie(request: Request, api_key: str) -> bool:
    return _same(unquote(request.cookies.get(KEY_COOKIE, "")), api_key)


def missing_key_error() -> OpenAIError:
    return OpenAIError(401, "Missing or incorrect API key; send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")
