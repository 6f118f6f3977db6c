"""The OpenAI Batch API (and the part of the Files API it needs) on top of the server's handlers.

    POST /v1/files (multipart: file, purpose=batch)   GET /v1/files, /v1/files/{id}, /v1/files/{id}/content
    DELETE /v1/files/{id}
    POST /v1/batches {input_file_id, endpoint, completion_window: "24h", metadata?}
    GET  /v1/batches (limit, after), /v1/batches/{id}   POST /v1/batches/{id}/cancel

OpenAI's conventions, so the official clients work unchanged: FileObject and Batch objects with
OpenAI's field names (`file-…`, `batch_…` ids, Unix-second timestamps, `request_counts`, `usage`),
cursor lists (`data`, `first_id`, `last_id`, `has_more`; newest first), OpenAI-shaped errors, the
JSONL input format (checked at upload, see batch_input.py) and output lines

    {"id": "batch_req_…", "custom_id": …, "response": {"status_code": 200, "request_id": …,
     "body": <the endpoint's response>}, "error": null}

A request the endpoint refuses (APIError: a bad body such as max_tokens "ten", an unknown model)
goes to the *error* file in the same shape, with its status code and OpenAI error body; the
upload does not validate bodies, as OpenAI's does not. A 503 (the server draining or its
engine down) is no verdict on the request: the line is left to run after a restart.
`request_counts.completed` counts the output file's lines and `failed` the error file's. Status:
validating -> in_progress -> finalizing -> completed, or after a cancel cancelling -> cancelled
(lines in flight are aborted; the files hold what finished). Output and error files exist once the
batch ends, and only if they have lines. `completion_window` is not enforced: a batch runs until
done, nothing expires.

Invariants (batch_runner.py has them in full): each custom_id appears exactly once in the output
or error file, whatever stops, kills (SIGKILL included) and restarts happen, since a request
counts as done only once its output line is fsynced, and only requests without one are launched.
`start()` resumes every unfinished batch: results finished before a stop or kill are kept byte for
byte, the requests in flight then run again. `stop()` stops launching, aborts the lines in flight
and persists every record. State lives under `state_dir` (layout in batch_store.py); without one,
a temporary directory, so batches then last only as long as the process. BatchService keeps the
batch records and the files; the BatchRunner it owns (batch_runner.py) runs the lines of the jobs
it is handed, through `server.run_batch_request`.
"""
from __future__ import annotations

import asyncio
import copy
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, StrictStr

from nanoserve.server.batch_input import BATCH_URLS, parse_batch_file, parse_form
from nanoserve.server.batch_runner import MAX_IN_FLIGHT, BatchRunner, Job
from nanoserve.server.batch_store import BatchStore, new_id
from nanoserve.server.errors import APIError

MAX_FILE_BYTES = 32 * 1024 * 1024  # per uploaded file (OpenAI allows 200 MB; we hold it in memory)
_FORM_OVERHEAD = 64 * 1024  # multipart headers and the purpose field around the file


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: StrictStr
    endpoint: StrictStr
    completion_window: StrictStr
    metadata: dict[StrictStr, StrictStr] | None = None
    output_expires_after: dict[str, Any] | None = None  # accepted; outputs stay until deleted


def link_to_batch() -> dict[str, Any]:
    """OpenAPI links from a created batch to the operations that take its id (a stateful fuzzer
    follows them: create -> retrieve, cancel)."""
    batch_id = {"batch_id": "$response.body#/id"}
    return {"responses": {"200": {"description": "The batch.", "links": {
        "RetrieveBatch": {"operationId": "retrieve_batch", "parameters": batch_id},
        "CancelBatch": {"operationId": "cancel_batch", "parameters": batch_id}}}}}


# The upload's body (the route reads the multipart form itself, so FastAPI cannot describe it) and
# the links from an uploaded file to what takes its id, for clients and for a stateful fuzzer.
_FILE_ID = "$response.body#/id"
UPLOAD_OPENAPI: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"},
                       "purpose": {"type": "string", "enum": ["batch"]}},
    }}}},
    "responses": {"200": {"description": "The uploaded file.", "links": {
        "RetrieveFile": {"operationId": "retrieve_file", "parameters": {"file_id": _FILE_ID}},
        "FileContent": {"operationId": "file_content", "parameters": {"file_id": _FILE_ID}},
        "DeleteFile": {"operationId": "delete_file", "parameters": {"file_id": _FILE_ID}},
        "CreateBatch": {"operationId": "create_batch", "requestBody": {
            "input_file_id": _FILE_ID, "endpoint": "/v1/completions", "completion_window": "24h"}}}}},
}


def _not_found(kind: str, object_id: str, param: str) -> APIError:
    return APIError(f"No such {kind}: {object_id!r}.", 404, param=param, code="not_found")


def _page(items: list[dict], limit: int, after: str | None) -> dict:
    if not 1 <= limit <= 10_000:
        raise APIError(f"limit must be between 1 and 10000 (got {limit}).", param="limit")
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


class BatchService:
    """The Files and Batches routes (`router`): the batch records (`jobs`, by id) and the files
    (`store`), with a BatchRunner that runs the batches' lines through `server.run_batch_request`.
    `max_file_bytes` and `max_in_flight` may be changed on a live service (tests make them small)."""

    def __init__(self, server: Any, state_dir: str | Path | None, *, max_file_bytes: int = MAX_FILE_BYTES,
                 max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.server = server
        self.state_dir = Path(state_dir) if state_dir is not None else Path(tempfile.mkdtemp(prefix="nanoserve-"))
        self.store = BatchStore(self.state_dir)
        self.jobs: dict[str, Job] = {r["id"]: Job(r) for r in self.store.load_batches()}
        self.runner = BatchRunner(server.run_batch_request, self.store, max_in_flight)
        self.max_file_bytes = max_file_bytes
        self.router = APIRouter()
        self._add_routes()

    @property
    def max_in_flight(self) -> int:
        """Batch lines running at once, over all batches (the runner's limit)."""
        return self.runner.max_in_flight

    @max_in_flight.setter
    def max_in_flight(self, value: int) -> None:
        self.runner.max_in_flight = value

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Resume every batch a previous run left unfinished."""
        await self.runner.start(self.jobs.values())

    async def stop(self) -> None:
        """Stop launching lines, abort those in flight (they re-run after a restart), persist."""
        await self.runner.stop(self.jobs.values())

    # -- the API -----------------------------------------------------------------------------
    async def create(self, req: CreateBatch) -> dict:
        if req.endpoint not in BATCH_URLS:
            raise APIError(f"Unsupported endpoint {req.endpoint!r}: nanoserve batches can call "
                           f"{' or '.join(BATCH_URLS)}.", param="endpoint", code="invalid_endpoint")
        if req.completion_window != "24h":
            raise APIError(f"completion_window must be '24h' (got {req.completion_window!r}).",
                           param="completion_window")
        if req.metadata is not None and len(req.metadata) > 16:
            raise APIError("metadata may hold at most 16 keys.", param="metadata")
        meta = self.store.files.get(req.input_file_id)
        if meta is None:
            raise _not_found("File", req.input_file_id, "input_file_id")
        if meta["purpose"] != "batch":
            raise APIError(f"File {req.input_file_id!r} has purpose {meta['purpose']!r}; a batch's input "
                           "file must be uploaded with purpose 'batch'.", param="input_file_id")
        lines = await asyncio.to_thread(lambda: parse_batch_file(self.store.file_content(req.input_file_id)))
        for line in lines:
            if line.url != req.endpoint:
                raise APIError(f"Line {line.number} of the input file has url {line.url!r}, but the batch's "
                               f"endpoint is {req.endpoint!r}; every line must match it.", param="endpoint",
                               code="mismatched_endpoint")
        now = int(time.time())
        rec: dict[str, Any] = {
            "id": new_id("batch_"), "object": "batch", "endpoint": req.endpoint, "errors": None,
            "input_file_id": req.input_file_id, "completion_window": req.completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
            "in_progress_at": None, "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": req.metadata,
            "model": self.server.model_name, "usage": None}
        self.store.save_batch(rec)
        job = self.jobs[rec["id"]] = Job(rec)
        self.runner.submit(job, lines)
        return copy.deepcopy(rec)

    def cancel(self, batch_id: str) -> dict:
        """cancelling now (the runner aborts the lines in flight), cancelled once that is done."""
        job = self._job(batch_id)
        status = job.record["status"]
        if status in ("completed", "failed", "expired"):
            raise APIError(f"Batch {batch_id!r} is already {status}; it cannot be cancelled.", param="batch_id")
        if status not in ("cancelling", "cancelled"):
            self.runner.cancel(job)
        return copy.deepcopy(job.record)

    def _job(self, batch_id: str) -> Job:
        job = self.jobs.get(batch_id)
        if job is None:
            raise _not_found("batch", batch_id, "batch_id")
        return job

    def _file(self, file_id: str) -> dict:
        meta = self.store.files.get(file_id)
        if meta is None:
            raise _not_found("File", file_id, "file_id")
        return meta

    async def upload(self, request: Request) -> dict:
        limit = self.max_file_bytes + _FORM_OVERHEAD
        too_big = APIError(f"The file is larger than {self.max_file_bytes} bytes, the most this server "
                           "accepts; split it into several batches.", 413, param="file", code="file_too_large")
        body, size = bytearray(), 0
        async for chunk in request.stream():  # read it all, even past the limit: the client is still
            size += len(chunk)                # sending and would not see a response sent early
            if size <= limit:
                body += chunk
            elif size > 8 * limit:
                raise too_big
        if size > limit:
            raise too_big
        form = parse_form(request.headers.get("content-type", ""), bytes(body))
        purpose = form.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
        if purpose != "batch":
            raise APIError(f"Unsupported purpose {purpose!r}: nanoserve keeps files for the Batch API only, "
                           "so purpose must be 'batch'.", param="purpose")
        if "file" not in form:
            raise APIError("Missing the 'file' field of the form.", param="file")
        filename, data = form["file"]
        if len(data) > self.max_file_bytes:
            raise too_big
        await asyncio.to_thread(parse_batch_file, data)
        return await asyncio.to_thread(self.store.add_file, data, filename or "batch.jsonl", "batch")

    def _add_routes(self) -> None:
        r = self.router

        @r.post("/v1/files", operation_id="upload_file", openapi_extra=UPLOAD_OPENAPI)
        async def upload(request: Request) -> dict:
            return await self.upload(request)

        @r.get("/v1/files")
        async def list_files(purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                             order: str = "desc") -> dict:
            files = [f for f in self.store.files.values() if purpose is None or f["purpose"] == purpose]
            files.sort(key=lambda f: (f["created_at"], f["id"]), reverse=order != "asc")
            return _page(files, limit, after)

        @r.get("/v1/files/{file_id}", operation_id="retrieve_file")
        async def get_file(file_id: str) -> dict:
            return self._file(file_id)

        @r.get("/v1/files/{file_id}/content", operation_id="file_content")
        async def file_content(file_id: str) -> Response:
            self._file(file_id)
            data = await asyncio.to_thread(self.store.file_content, file_id)
            return Response(data, media_type="application/octet-stream")

        @r.delete("/v1/files/{file_id}", operation_id="delete_file")
        async def delete_file(file_id: str) -> dict:
            self._file(file_id)
            self.store.delete_file(file_id)
            return {"id": file_id, "object": "file", "deleted": True}

        @r.post("/v1/batches", operation_id="create_batch", openapi_extra=link_to_batch())
        async def create_batch(body: CreateBatch) -> dict:
            return await self.create(body)

        @r.get("/v1/batches")
        async def list_batches(limit: int = 20, after: str | None = None) -> dict:
            records = sorted((copy.deepcopy(j.record) for j in self.jobs.values()), key=lambda b: b["id"],
                             reverse=True)
            return _page(records, min(limit, 100), after)

        @r.get("/v1/batches/{batch_id}", operation_id="retrieve_batch")
        async def get_batch(batch_id: str) -> dict:
            return copy.deepcopy(self._job(batch_id).record)

        @r.post("/v1/batches/{batch_id}/cancel", operation_id="cancel_batch")
        async def cancel_batch(batch_id: str) -> dict:
            return self.cancel(batch_id)
