"""Request ids: a request can be followed from a proxy's log into ours.

An incoming `X-Request-Id` header is kept (a proxy or client set it; anything printable up to
128 characters), otherwise one is made; either way it comes back in the response's
`X-Request-Id` header -- errors included -- and the route finds it in `request.state.request_id`,
from where it reaches the per-request log line (`metrics.log_request`). OpenAI sends its own as
`x-request-id` too.

A pure ASGI middleware rather than Starlette's `BaseHTTPMiddleware`: that one runs the app in a
task of its own and hides the client's disconnect from a streaming response, which must see it
to abort its generation (streaming.py).
"""
from __future__ import annotations

import uuid
from typing import Any

Scope = dict[str, Any]
HEADER = b"x-request-id"
MAX_LENGTH = 128


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id if it is a sane one, else a new one."""
    for name, value in headers:
        if name.lower() == HEADER:
            text = value.decode("latin-1").strip()
            if 0 < len(text) <= MAX_LENGTH and text.isprintable():
                return text
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Gives every HTTP request an id (the client's X-Request-Id or a new one) and returns it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope["headers"])
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)
