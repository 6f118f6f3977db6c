"""`--api-key`: only clients that know a key may use the API.

Every `/v1/*` route wants `Authorization: Bearer <key>` with one of the server's keys (several
may be given, so a key can be rotated without downtime); anything else gets a 401 in OpenAI's
error shape, as OpenAI and vLLM answer. `/health`, `/metrics` and `/version` stay open, as in
vLLM, so probes and scrapers need no key. Keys are compared with `hmac.compare_digest`, whose
time does not depend on where a guess goes wrong, so the comparison leaks nothing of a key.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from typing import Any

PROTECTED_PREFIX = "/v1"


class APIKeyMiddleware:
    """Refuse `/v1/*` requests that do not carry one of `keys` as a Bearer token (401)."""

    def __init__(self, app: Any, keys: Sequence[str]) -> None:
        if not keys or any(not k for k in keys):
            raise ValueError("API keys must be non-empty strings")
        self.app = app
        self.keys = [k.encode() for k in keys]

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        token = b""
        for name, value in headers:
            if name.lower() == b"authorization" and value[:7].lower() == b"bearer ":
                token = value[7:].strip()
        # Every key is compared, whichever matches: the time says nothing about which one did.
        return any([hmac.compare_digest(token, key) for key in self.keys])

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"  # CORS preflights carry no key
                or not scope["path"].startswith(PROTECTED_PREFIX) or self.authorized(scope["headers"])):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "Incorrect or missing API key: send it as 'Authorization: Bearer "
                                                "<key>'.", "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
