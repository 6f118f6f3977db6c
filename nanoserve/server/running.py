"""Running one API request: its choices (one engine request each), launched the moment the
request is admitted, and their outputs merged into one stream.

Launching is synchronous, in the handler, right after admission: the request is counted as
queued (`Admission`) before the handler yields to any other, so a burst cannot slip past
`--max-queued` between the check and the count. Every path out releases what it holds, even a
response whose body never starts (the client left before the first byte): `cancel()` is
idempotent, and each choice's count is released by its task's done-callback, which runs even for
a task cancelled before it ever ran.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from functools import partial

from nanoserve.async_engine import AsyncEngine, EngineError
from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.server.admission import Admission
from nanoserve.server.errors import APIError
from nanoserve.server.metrics import ServerMetrics, log_request
from nanoserve.slo import SLO, RequestClass


@dataclass(frozen=True)
class Choice:
    """One engine request: choice `index` of the response (n per prompt, prompts in order)."""

    index: int
    token_ids: list[int]
    params: SamplingParams
    request_id: str
    priority: RequestClass = RequestClass.ONLINE
    slo: SLO | None = None  # None: the class's targets
    deadline: float | None = None  # time.monotonic() by which it must finish, else it is cut off
    http_request_id: str | None = None  # the HTTP request's X-Request-Id (request_ids.py), for the log

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority", RequestClass(self.priority))  # "online"/"offline" too


class Launch:
    def __init__(self, engine: AsyncEngine, admission: Admission, metrics: ServerMetrics,
                 choices: list[Choice]) -> None:
        self.engine, self.admission, self.metrics, self.choices = engine, admission, metrics, choices
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self._waiting = {c.index for c in choices}  # counted as queued: no first token yet
        for choice in choices:
            admission.entered(choice.priority)
        self._tasks = [asyncio.create_task(self._pump(c)) for c in choices]
        for choice, task in zip(choices, self._tasks):
            task.add_done_callback(partial(self._pump_done, choice))
        self._remaining = len(choices)

    def _started(self, choice: Choice, started: bool) -> None:
        if choice.index in self._waiting:
            self._waiting.discard(choice.index)
            self.admission.left(choice.priority, started)

    def _pump_done(self, choice: Choice, _task: asyncio.Task[None]) -> None:
        self._started(choice, False)

    async def _pump(self, choice: Choice) -> None:
        last: RequestOutput | None = None
        try:
            async for out in self.engine.generate(choice.token_ids, choice.params, choice.request_id,
                                                  priority=choice.priority, slo=choice.slo):
                self._started(choice, True)
                last = out
                self._queue.put_nowait((choice.index, out))
        except Exception as exc:  # CancelledError passes: it means we are being torn down
            self._queue.put_nowait((choice.index, exc))
        finally:
            finished = last is not None and last.finished
            log_request(choice.request_id, choice.priority, len(choice.token_ids), last, None if finished else "abort",
                        choice.http_request_id)
            if finished:
                assert last is not None
                self.metrics.observe_finished(last, choice.priority)

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """The choices' outputs in arrival order, until every one finishes (or the earliest
        deadline passes: then a 408, and the rest are aborted)."""
        deadline = min((c.deadline for c in self.choices if c.deadline is not None), default=None)
        try:
            while self._remaining:
                try:
                    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                    index, item = await asyncio.wait_for(self._queue.get(), timeout)
                except TimeoutError:
                    raise APIError("The request timed out before it finished; its generation was stopped.",
                                   408, code="request_timeout") from None
                if isinstance(item, BaseException):
                    raise as_api_error(item)
                if item.finished:
                    self._remaining -= 1
                yield index, item
        finally:
            self.cancel()

    async def finals(self) -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for index, out in self.outputs():
            if out.finished:
                finals[index] = out
        return [finals[c.index] for c in self.choices]

    def cancel(self) -> None:
        """Abort every choice still running (a no-op for finished ones, and when called again)."""
        if self._tasks:
            for task in self._tasks:
                task.cancel()
            self._tasks = []
            self.metrics.observe_aborted(self._remaining)


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(str(exc))
    if isinstance(exc, EngineError):
        return APIError(str(exc), 500)
    return APIError(f"Internal error: {type(exc).__name__}: {exc}", 500)

