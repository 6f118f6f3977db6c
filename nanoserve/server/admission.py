"""Back-pressure: which requests the server takes in, and what it tells the ones it turns away.

A queue that grows without bound serves nobody: every request waits behind all the others, and
clients time out after the server has already spent KV memory on them. So, as vLLM's and
OpenAI's servers do, nanoserve refuses work it cannot start soon and says when to come back:

- `max_queued` bounds the online requests admitted but not yet started (no first token). Past
  it an online request gets 429 `rate_limit_exceeded` with a `Retry-After` header: the seconds
  the queue ahead of it takes to drain at the rate requests have been starting lately.
- Offline requests (`"priority": "offline"`, and every batch line) are never refused, only
  queued: they are the work that fills the gaps, and a batch must not fail because the server
  was busy when a line's turn came. They do not count against the bound either.
- While the server drains for shutdown (SIGTERM), everything new gets 503 with `Retry-After`:
  the request is fine, this process is going away. (A server whose engine is down says 503 too,
  before admission: see `OpenAIServer.admit`.)

All counting happens on the event loop, the only thread that admits and starts requests, so
the check and the count it guards cannot race.
"""
from __future__ import annotations

import math
import time
from collections import deque

from nanoserve.server.errors import APIError
from nanoserve.slo import PRIORITIES, RequestClass

RATE_WINDOW_S = 30.0  # how far back "lately" looks for the start rate
MAX_RETRY_AFTER_S = 60


class Admission:
    def __init__(self, max_queued: int | None = None) -> None:
        if max_queued is not None and max_queued < 0:
            raise ValueError("max_queued must be >= 0")
        self.max_queued = max_queued
        self.draining = False  # set at the start of a graceful shutdown
        self.queued = {cls: 0 for cls in PRIORITIES}  # admitted, no first token yet
        self.rejected = 0
        self._starts: deque[float] = deque()  # when recent requests got their first token

    def start_draining(self) -> bool:
        """A graceful shutdown began: from now on every new request is turned away with a 503.
        True the first time (the caller logs it), False after."""
        first, self.draining = not self.draining, True
        return first

    # -- the gate ------------------------------------------------------------------------
    def check(self, priority: RequestClass, count: int) -> None:
        """Raise the error that turns away `count` new requests of `priority`, if any."""
        if self.draining:
            self.rejected += count
            raise APIError("The server is shutting down; retry against another replica or later.", 503,
                           code="server_unavailable", headers={"Retry-After": str(self.retry_after())})
        if priority != RequestClass.ONLINE or self.max_queued is None:  # == : safe for a raw string too
            return
        online = self.queued[RequestClass.ONLINE]
        if online + count > self.max_queued:
            self.rejected += count
            raise APIError(f"Too many requests queued ({online} online requests waiting to start, "
                           f"limit {self.max_queued}); retry after the Retry-After seconds.", 429,
                           code="rate_limit_exceeded", type="rate_limit_exceeded",
                           headers={"Retry-After": str(self.retry_after())})

    # -- the counts, kept by the request's own task -------------------------------------------
    def entered(self, priority: RequestClass) -> None:
        self.queued[priority] = self.queued.get(priority, 0) + 1

    def left(self, priority: RequestClass, started: bool) -> None:
        """The request got its first token (`started`), or ended without one."""
        self.queued[priority] -= 1
        if started:
            now = time.monotonic()
            self._starts.append(now)
            while self._starts and self._starts[0] < now - RATE_WINDOW_S:
                self._starts.popleft()

    def retry_after(self) -> int:
        """Seconds until the online queue ahead has likely started, from the recent start rate."""
        now = time.monotonic()
        recent = [t for t in self._starts if t >= now - RATE_WINDOW_S]
        if not recent:
            return 1
        rate = len(recent) / max(1.0, now - recent[0])
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.queued[RequestClass.ONLINE] / rate)))
