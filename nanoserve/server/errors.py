"""OpenAI-shaped errors: every failure the server reports has the body

    {"error": {"message": "...", "type": "...", "param": <field or null>, "code": <str or null>}}

because OpenAI clients (the official SDKs, LangChain, ...) parse exactly that shape to raise
their typed exceptions; a FastAPI-style `{"detail": ...}` would surface as an opaque error.

Client mistakes are 4xx with a message that names the field and what was expected, so a user
can fix the request without reading server logs. FastAPI's own validation errors are mapped
from 422 to 400, the status OpenAI and vLLM use for a malformed request.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("nanoserve.server")

# OpenAI's error `type` per status; clients key retry logic off the status, humans off the type.
_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          408: "timeout_error", 413: "invalid_request_error", 415: "invalid_request_error",
          429: "rate_limit_exceeded", 500: "server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error to send to the client as-is. Raise it anywhere inside a route."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None,
                 code: str | None = None, type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.headers = headers or {}
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def model_not_found(name: str) -> APIError:
    # vLLM's wording, so scripts that match on it keep working.
    return APIError(f"The model `{name}` does not exist.", 404, param="model", code="model_not_found")


def _loc_to_field(loc: tuple[Any, ...]) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _show(value: Any, limit: int = 60) -> str:
    # The offending value helps, but must stay short and must not break JSON (NaN, bytes, ...).
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one readable 400 naming the first bad field."""
    if not errors:
        return APIError("The request is invalid.")
    err = errors[0]
    kind = err.get("type", "")
    loc = tuple(err.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    if kind == "json_invalid":
        # FastAPI cuts json's "...: line 1 column 11 (char 10)" tail off the reason; put it back.
        reason = str((err.get("ctx") or {}).get("error", "malformed JSON")).removesuffix(" at")
        where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return APIError(f"The request body is not valid JSON: {reason}{where}.", code="invalid_json")
    if not loc:  # the body as a whole
        if kind == "missing":
            return APIError("The request body is empty; expected a JSON object.", code="invalid_json")
        got = type(err.get("input")).__name__ if err.get("input") is not None else "null"
        return APIError(f"The request body must be a JSON object, got {got}.", code="invalid_json")
    field = _loc_to_field(loc)
    if kind == "missing":
        return APIError(f"Missing required field '{field}'.", param=field)
    message = str(err.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    shown = f" (got {_show(err['input'])})" if "input" in err and kind != "value_error" else ""
    return APIError(f"Invalid value for '{field}': {message}{shown}.{more}", param=field)


def install_error_handlers(app: FastAPI, on_error: Callable[[str], None] | None = None) -> None:
    """Route every exception the app can raise to an OpenAI-shaped JSON response.
    `on_error(type)` is told of each refused or failed request (for the metrics)."""

    def respond(error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(error.type)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 500:
            log.error("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}. See GET /v1/models, " \
                      "POST /v1/completions, POST /v1/chat/completions, GET /health, GET /metrics."
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}."
        elif isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
            bad = exc.__cause__
            return respond(APIError(f"The request body is not valid UTF-8: byte 0x{bad.object[bad.start]:02x} at "
                                    f"position {bad.start}. Send JSON encoded as UTF-8.", code="invalid_json"))
        else:
            message = str(exc.detail)
        return APIError(message, exc.status_code).response()

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return respond(APIError(f"The request body is not valid JSON: {exc.msg} at character {exc.pos}.",
                                code="invalid_json"))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        # A bug in the server: log it with the traceback, tell the client only what happened.
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return respond(APIError(f"Internal server error: {type(exc).__name__}: {exc}", 500))
