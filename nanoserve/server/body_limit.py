"""A request body over the limit gets a 413, before it is parsed (OpenAI's error shape).

FastAPI reads a JSON body whole into memory before validating it, so without a limit one client
could make the server hold any amount. The limit is on the bytes the client sends: a
`Content-Length` over it is refused at once; a chunked body is read here as it arrives, refused
once past it, else handed on whole. File uploads (`/v1/files`) have their own, larger limit
(batches.py) and are left to it.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

MAX_BODY_BYTES = 16 * 1024 * 1024
DRAIN_FACTOR = 8  # a body up to this many times the limit is read before the 413 (batches.py does too)


class BodyLimitMiddleware:
    """Refuse (413) request bodies over `max_bytes`, except under `exempt` path prefixes."""

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES, exempt: Sequence[str] = ("/v1/files",)) -> None:
        self.app, self.max_bytes, self.exempt = app, max_bytes, tuple(exempt)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self.exempt):
            await self.app(scope, receive, send)
            return
        length = next((value for name, value in scope["headers"] if name.lower() == b"content-length"), None)
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                # Read (and drop) what the client is still sending, up to 8x the limit: a response
                # sent while it sends would reach it as a reset connection, not as this 413.
                if int(length) <= DRAIN_FACTOR * self.max_bytes:
                    while (await receive()).get("more_body", False):
                        pass
                await self._refuse(send)
                return
            await self.app(scope, receive, send)
            return
        # No Content-Length (a chunked body): read it here, up to the limit, and hand it on whole.
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replayed() -> dict[str, Any]:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send: Any) -> None:
        body = json.dumps({"error": {"message": f"The request body is larger than {self.max_bytes} bytes, the most "
                                                "this server accepts.", "type": "invalid_request_error",
                                     "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
