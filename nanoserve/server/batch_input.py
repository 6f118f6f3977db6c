"""What a client uploads for the Batch API, checked before anything is stored: the multipart
form of `POST /v1/files` and the JSONL request file inside it.

A batch input file, as OpenAI defines it: one JSON object per line,

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

`custom_id` unique in the file (it is how a client matches outputs to inputs, since output order
is not promised), `method` POST, `url` one of the endpoints a batch may call, `body` an object.
Blank lines are skipped. Each problem is a 400 naming the line (1-based, as an editor counts).
The body itself is *not* validated here: a body the endpoint would refuse (say `max_tokens`
"ten") becomes that request's entry in the batch's error file, with the endpoint's own 400, as
OpenAI does; one bad request does not sink the other 49,999.

The form is parsed here rather than with python-multipart (which FastAPI would need for
`UploadFile`), so the server needs no extra dependency for one route.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from nanoserve.server.errors import APIError

BATCH_URLS = ("/v1/completions", "/v1/chat/completions")
MAX_REQUESTS = 50_000  # OpenAI's limit per batch file

_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_PARAM = re.compile(r';\s*([\w*]+)="((?:[^"\\]|\\.)*)"|;\s*([\w*]+)=([^;\s]+)')


@dataclass(frozen=True)
class BatchLine:
    index: int  # 0-based position among the file's requests
    number: int  # 1-based line number in the file (blank lines count)
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """multipart/form-data -> {field name: (filename or None, bytes)}; the first part per name."""
    match = _BOUNDARY.search(content_type or "")
    if not (content_type or "").lower().startswith("multipart/form-data") or match is None:
        raise APIError("Upload the file as multipart/form-data with the fields 'file' and 'purpose'.",
                       code="invalid_content_type")
    delimiter = b"\r\n--" + (match.group(1) or match.group(2)).encode("latin-1")
    chunks = (b"\r\n" + body).split(delimiter)
    fields: dict[str, tuple[str | None, bytes]] = {}
    for chunk in chunks[1:]:
        if chunk.startswith(b"--"):
            break  # the closing delimiter
        head, sep, data = chunk.partition(b"\r\n\r\n")
        if not sep:
            raise APIError("Malformed multipart body: a part has no header/content separator.")
        params: dict[str, str] = {}
        for header in head.decode("latin-1").split("\r\n"):
            name, _, value = header.partition(":")
            if name.strip().lower() == "content-disposition":
                for m in _PARAM.finditer(value):
                    key = (m.group(1) or m.group(3)).lower()
                    params[key] = m.group(2).replace('\\"', '"') if m.group(1) else m.group(4)
        if "name" in params:
            filename = params.get("filename")
            if filename is not None:  # browsers and httpx send UTF-8 names as raw bytes
                filename = filename.encode("latin-1", "replace").decode("utf-8", "replace")
            fields.setdefault(params["name"], (filename, data))
    else:
        raise APIError("Malformed multipart body: the closing boundary is missing.")
    return fields


def parse_batch_file(data: bytes) -> list[BatchLine]:
    """Validate a batch input file; its requests in order, or a 400 naming the first bad line."""
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _bad(number, f"is not valid UTF-8 (byte {exc.start + 1})", "invalid_encoding") from exc
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise _bad(number, f"is not valid JSON ({exc}); a batch file is JSONL, one JSON object per line",
                       "invalid_jsonl") from exc
        if not isinstance(obj, dict):
            raise _bad(number, f"must be a JSON object, got {type(obj).__name__}", "invalid_jsonl")
        custom_id, method, url, body = (obj.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id:
            raise _bad(number, "needs a non-empty string 'custom_id'", param="custom_id")
        if custom_id in seen:
            raise _bad(number, f"repeats custom_id {custom_id!r} (first on line {seen[custom_id]}); "
                       "each request needs its own", "duplicate_custom_id", "custom_id")
        if method != "POST":
            raise _bad(number, f"has method {method!r}; batch requests must use 'POST'", param="method")
        if url not in BATCH_URLS:
            raise _bad(number, f"has url {url!r}; a batch may call {' or '.join(BATCH_URLS)}", param="url")
        if not isinstance(body, dict):
            raise _bad(number, "needs 'body', the request as a JSON object", param="body")
        seen[custom_id] = number
        lines.append(BatchLine(len(lines), number, custom_id, url, body))
        if len(lines) > MAX_REQUESTS:
            raise APIError(f"The file has more than {MAX_REQUESTS} requests, the most one batch may hold.",
                           code="too_many_requests_in_file")
    if not lines:
        raise APIError("The file holds no requests: a batch file is JSONL, one request per line.",
                       code="empty_file", param="file")
    return lines


def _bad(number: int, problem: str, code: str = "invalid_request", param: str | None = None) -> APIError:
    return APIError(f"Line {number} of the file {problem}.", code=code, param=param or "file")
