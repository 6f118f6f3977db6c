"""How batches run: each line through `OpenAIServer.run_batch_request` (the endpoint's own
validation and handler, as the offline class), at most `max_in_flight` lines at a time over all
batches, so a large batch never floods the engine's waiting queue and online traffic keeps its
priority. `BatchService` (batches.py) owns the batches and one `BatchRunner`, and puts the HTTP API
on top; batch_store.py keeps the state on disk.

Invariants:
  * Exactly once: a request counts as done when its output line is fsynced to the batch's
    results log, and only a request without a line there is ever launched; so each custom_id
    appears exactly once in the output or error file, whatever stops, kills and restarts happen.
  * Restart: `start()` resumes every batch not in a final state. Results logged before a stop
    or a kill (SIGKILL included) are kept byte for byte (the output file is made of those very
    lines); a torn last line is dropped; requests in flight at the stop or kill left no line and
    run again. A batch cancelling or finalizing at the kill is finished on restart.
  * A line answered 503 (the server draining for shutdown, or its engine down) is not the
    line's fault: it gets no result, the batch stops launching and waits, in_progress, for the
    restart that runs it again, rather than failing requests that would succeed a minute later.
  * `stop()` stops launching lines, cancels those in flight (which aborts their engine requests
    and frees their KV) without writing their results, and persists every record.
  * Output and error files are written once the batch ends, in input order, under ids derived
    from the batch's, so finalizing again after a crash rewrites the same files.
  * Live `request_counts` are kept in memory and persisted on each status change; on load they
    are recounted from the results log, which is the truth.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nanoserve.server.batch_input import BatchLine, parse_batch_file
from nanoserve.server.batch_store import BatchStore, ResultLog, derived_id, new_id
from nanoserve.server.errors import APIError
from nanoserve.server.running import as_api_error

log = logging.getLogger("nanoserve.server.batches")

MAX_IN_FLIGHT = 16  # batch lines running at once, over all batches
FINAL = ("completed", "failed", "cancelled", "expired")

RunRequest = Callable[[str, dict[str, Any]], Awaitable[dict]]  # (url, body) -> the endpoint's response body


@dataclass
class Job:
    """One batch as its owner keeps it and the runner moves it along."""

    record: dict  # the Batch object, as persisted
    lines: list[BatchLine] = field(default_factory=list)
    log: ResultLog | None = None
    runner: asyncio.Task | None = None
    tasks: set[asyncio.Task] = field(default_factory=set)


def _status(line: bytes) -> int:
    return json.loads(line)["response"]["status_code"]


class BatchRunner:
    """Runs batches' lines through `run_request`, at most `max_in_flight` at a time over all the jobs
    it is given. The owner keeps the jobs (their records included); the runner moves them along,
    through this interface:

        start(jobs)              resume the jobs not in a final state; then accept new ones
        submit(job, lines=None)  run a new job now if started (else the next start() resumes it)
        cancel(job)              mark it cancelling and abort its lines in flight; it ends cancelled
        stop(jobs)               stop launching, abort the lines in flight, close the logs, persist
        max_in_flight            read at each launch, so it may be changed at any time
    """

    def __init__(self, run_request: RunRequest, store: BatchStore, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.max_in_flight = max_in_flight
        self._run_request = run_request
        self._store = store
        self._in_flight = 0
        self._slot_freed = asyncio.Event()
        self._running = False
        self._unavailable = False  # a line got 503: the server is draining or its engine is down

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, jobs: Iterable[Job]) -> None:
        """Resume every batch a previous run left unfinished."""
        self._running = True
        self._unavailable = False
        self._slot_freed = asyncio.Event()  # of this event loop
        for job in jobs:
            if job.record["status"] not in FINAL and job.runner is None:
                self._launch(job)

    async def stop(self, jobs: Iterable[Job]) -> None:
        """Stop launching lines, abort those in flight (they re-run after a restart), persist."""
        self._running = False
        jobs = list(jobs)
        runners = [job.runner for job in jobs if job.runner is not None]
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        for job in jobs:
            job.runner = None
            if job.log is not None:
                job.log.close()
            if job.record["status"] not in FINAL:
                self._store.save_batch(job.record)

    def submit(self, job: Job, lines: list[BatchLine] | None = None) -> None:
        """Run a job just created (`lines`: its input file, already parsed), if the runner is
        started; if not, it waits, validating, for `start()`."""
        if self._running:
            self._launch(job, lines)

    def cancel(self, job: Job) -> None:
        """cancelling now (its runner aborts the lines in flight), cancelled once that is done."""
        self._set(job, "cancelling")
        if job.runner is not None:
            job.runner.cancel()
        elif self._running:
            self._launch(job)

    def _launch(self, job: Job, lines: list[BatchLine] | None = None) -> None:
        rec = job.record
        try:
            job.lines = lines if lines is not None else parse_batch_file(self._store.file_content(rec["input_file_id"]))
        except (OSError, APIError) as exc:
            self._fail(job, "invalid_input_file", f"The input file cannot be read: {exc}")
            return
        job.log = self._store.results(rec["id"])
        wanted = {line.custom_id for line in job.lines}
        statuses = [_status(v) for k, v in job.log.lines.items() if k in wanted]
        rec["request_counts"] = {"total": len(job.lines), "completed": statuses.count(200),
                                 "failed": len(statuses) - statuses.count(200)}
        job.runner = asyncio.create_task(self._run(job), name=f"batch {rec['id']}")

    def _set(self, job: Job, status: str) -> None:
        job.record["status"] = status
        job.record[f"{status}_at"] = int(time.time())
        self._store.save_batch(job.record)

    def _fail(self, job: Job, code: str, message: str) -> None:
        log.error("batch %s failed: %s", job.record["id"], message)
        job.record["errors"] = {"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                             "line": None}]}
        self._set(job, "failed")

    # -- running -----------------------------------------------------------------------------
    async def _run(self, job: Job) -> None:
        rec = job.record
        try:
            if rec["status"] == "validating":
                self._set(job, "in_progress")
            if rec["status"] == "in_progress":
                assert job.log is not None  # opened by _launch, which started this runner
                for line in job.lines:
                    if line.custom_id in job.log.lines:
                        continue  # finished before a restart
                    while self._in_flight >= self.max_in_flight:
                        self._slot_freed.clear()
                        await self._slot_freed.wait()
                    if self._unavailable:
                        break
                    self._in_flight += 1
                    task = asyncio.create_task(self._run_line(job, line))
                    job.tasks.add(task)
                    task.add_done_callback(lambda t: self._line_done(job, t))
                while job.tasks:
                    await asyncio.wait(set(job.tasks))
                if self._unavailable and rec["status"] == "in_progress":
                    log.warning("batch %s paused: the server is unavailable; it resumes after a restart", rec["id"])
                    self._store.save_batch(rec)
                    job.runner = None
                    return
        except asyncio.CancelledError:
            for task in job.tasks:
                task.cancel()  # aborts the engine requests; no result line is written
            await asyncio.gather(*job.tasks, return_exceptions=True)
            if rec["status"] != "cancelling":
                raise  # stop(): the batch resumes after a restart
        except Exception as exc:  # a bug or a full disk: report it on the batch, not silently
            log.exception("batch %s", rec["id"])
            self._fail(job, "internal_error", f"{type(exc).__name__}: {exc}")
            job.runner = None
            return
        self._finalize(job)
        job.runner = None

    def _line_done(self, job: Job, task: asyncio.Task) -> None:
        job.tasks.discard(task)
        self._in_flight -= 1
        self._slot_freed.set()

    async def _run_line(self, job: Job, line: BatchLine) -> None:
        try:
            body = await self._run_request(line.url, line.body)
            status, request_id = 200, str(body.get("id") or uuid.uuid4().hex)
        except Exception as exc:  # CancelledError is not an Exception: a cancelled line writes nothing
            error = as_api_error(exc)  # what the endpoint would have answered
            if error.status == 503:  # not the line's fault (draining, engine down): no result, so it
                self._unavailable = True  # runs again after a restart instead of failing for good
                return
            if not isinstance(exc, APIError):
                log.exception("batch %s, line %s", job.record["id"], line.custom_id)
            status, body, request_id = error.status, error.body(), uuid.uuid4().hex
        out = {"id": new_id("batch_req_"), "custom_id": line.custom_id,
               "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}
        assert job.log is not None  # opened by _launch
        job.log.append(line.custom_id, json.dumps(out, ensure_ascii=False).encode())
        job.record["request_counts"]["completed" if status == 200 else "failed"] += 1

    def _finalize(self, job: Job) -> None:
        """Write the output and error files (idempotent: their ids derive from the batch's)."""
        rec = job.record
        assert job.log is not None  # opened by _launch
        final = "cancelled" if rec["status"] == "cancelling" else "completed"
        if final == "completed" and rec["status"] != "finalizing":
            self._set(job, "finalizing")
        order = {line.custom_id: line.index for line in job.lines}
        done = sorted((order[k], v) for k, v in job.log.lines.items() if k in order)
        ok = [v for _, v in done if _status(v) == 200]
        kinds = {"output": ok, "error": [v for _, v in done if _status(v) != 200]}
        for kind, lines in kinds.items():
            if lines:
                file_id = derived_id("file-", rec["id"], kind)
                self._store.add_file(b"\n".join(lines) + b"\n", f"{rec['id']}_{kind}.jsonl", "batch_output", file_id)
                rec[f"{kind}_file_id"] = file_id
        usage = [json.loads(v)["response"]["body"].get("usage") or {} for v in ok]
        tokens_in, tokens_out = (sum(u.get(k, 0) for u in usage) for k in ("prompt_tokens", "completion_tokens"))
        cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usage)
        rec["usage"] = {"input_tokens": tokens_in, "input_tokens_details": {"cached_tokens": cached},
                        "output_tokens": tokens_out, "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": tokens_in + tokens_out}
        rec["request_counts"] = {"total": len(job.lines), "completed": len(ok), "failed": len(done) - len(ok)}
        self._set(job, final)
        job.log.close()
        log.info("batch %s %s: %s", rec["id"], final, rec["request_counts"])
