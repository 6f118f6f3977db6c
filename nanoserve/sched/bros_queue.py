"""The queues BROS pulls requests from instead of sorting them each step (bros.txt §4.2, Fig. 8
"request pulling": partial sorting and queue polling).

With thousands of requests waiting, Alg. 1 needs only the few at the front of each order: the
batch takes at most its batch size, usually far fewer waiting requests. So the waiting requests
are not sorted, nor even scanned, per step: each class keeps a `PolledQueue`, a min-heap filed
once, when a request joins the queue, under its rank in Alg. 1's order:

    RT (online)        its next token's deadline (Eq. (6); fixed while it waits)
    BE (offline)       its KV slots on the host (line 17's swap-in cost; fixed while it waits:
                       a waiting request is either swapped out whole or has no KV at all)

ties going to the request further ahead in the scheduler's waiting deque (`QueuePositions`).
A step pulls requests in that order and puts back those it did not admit, so it touches only the
requests it considers. In the common case (arrivals with one SLO) the RT heap's order is just the
queue's; the heap also serves the exceptions the paper glosses over, requests preempted back to
the head and requests with their own SLO, without ever checking that the queue is sorted.

A request leaves its heap lazily: `discard` forgets its entry, which the heap drops when it
surfaces (or when stale entries outnumber live ones).

`BROSScheduler` owns one `PulledQueues` and tells it of every change to its queues (a request
added, preempted, admitted, finished, or given a token); the queues hand back Alg. 1's
candidates in order. What they need of the KV manager (host slots) comes in as arguments, read
through the `KVManager` interface.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Generator, Iterable
from typing import Any

from nanoserve.request import Request
from nanoserve.sched.bros_batch import INF, is_rt
from nanoserve.sched.output import SchedulerOutput

Rank = Any  # anything ordered: a deadline, a slot count, a seniority tuple
_Entry = tuple[Rank, int, Request]  # (rank, queue position, request)


class QueuePositions:
    """Where requests stand in a deque that takes arrivals at the back and preempted requests at
    the front: later arrivals count up, later preemptions count down, so comparing two numbers
    compares the two requests' places in the deque (removals never reorder it)."""

    def __init__(self) -> None:
        self._back = itertools.count(0)
        self._front = itertools.count(-1, -1)

    def back(self) -> int:
        return next(self._back)

    def front(self) -> int:
        return next(self._front)


class PolledQueue:
    """Requests by (rank, position), pulled lazily without sorting or scanning the rest."""

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._entries: dict[Request, _Entry] = {}  # the live entry of each request in the queue
        self._pulling = False  # a pull holds entries outside the heap: no compaction meanwhile

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request: Request) -> bool:
        return request in self._entries

    def push(self, request: Request, rank: Rank, position: int) -> None:
        """File `request` (again, replacing any earlier entry) under `rank`."""
        entry = (rank, position, request)
        self._entries[request] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._entries) + 64 and not self._pulling:
            self._heap[:] = self._entries.values()  # mostly stale: keep the live entries
            heapq.heapify(self._heap)

    def discard(self, request: Request) -> None:
        self._entries.pop(request, None)

    def first(self) -> Request | None:
        """The request at the front, without taking it out."""
        heap, entries = self._heap, self._entries
        while heap and entries.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)  # stale: its request left the queue
        return heap[0][2] if heap else None

    def pull(self) -> Generator[tuple[Rank, Request], None, None]:
        """(rank, request) in order, popped only as far as the caller reads. Requests still in
        the queue when the iterator closes go back in; entries filed meanwhile are pulled too."""
        assert not self._pulling, "one pull at a time"
        heap, entries, taken = self._heap, self._entries, []
        self._pulling = True
        try:
            while heap:
                entry = heapq.heappop(heap)
                if entries.get(entry[2]) is entry:
                    taken.append(entry)
                    yield entry[0], entry[2]
        finally:
            self._pulling = False
            for entry in taken:
                if entries.get(entry[2]) is entry:  # not admitted, finished or refiled meanwhile
                    heapq.heappush(heap, entry)

    def key(self, request: Request) -> tuple[Rank, int] | None:
        """`request`'s (rank, position), if it is in the queue."""
        entry = self._entries.get(request)
        return None if entry is None else entry[:2]

    def requests(self) -> list[Request]:
        """Every request in the queue, in order (for tests and checks; sorts)."""
        return [entry[2] for entry in sorted(self._entries.values(), key=lambda e: e[:2])]


class Deadlines(dict):
    """RT request -> when its next token is due (Eq. (6)): arrival + TTFT before its first token,
    the last token + TPOT after. Kept up to date as tokens come (`sampled`), so sorting by it costs
    a lookup per request; one not seen before is assumed to have kept its TPOT pace."""

    def __missing__(self, request: Request) -> float:
        slo = request.slo
        if request.first_token_time is None:
            due = request.arrival_time + slo.ttft if slo.ttft is not None else INF
        else:
            due = request.first_token_time + slo.tpot * request.num_output_tokens if slo.tpot is not None else INF
        self[request] = due
        return due

    def sampled(self, request: Request, now: float) -> None:
        """`request` got a token at `now`: the next is due a TPOT later."""
        tpot = request.slo.tpot
        self[request] = now + tpot if tpot is not None else INF


class PulledQueues:
    """The scheduler's side of request pulling: files each request in its class's queue as it
    arrives, is preempted, admitted or finished, and yields Alg. 1's candidates in order.

    Its owner (`BROSScheduler`) calls `add`, `preempt`, `admit` and `finish` right after its own
    queues changed, `sampled` after each step, and `sync` before each plan. `due` holds each RT
    request's next deadline; `rt_waiting` and `be_waiting` are the waiting requests' heaps (for
    reading)."""

    def __init__(self) -> None:
        self._positions = QueuePositions()
        self.rt_waiting = PolledQueue()  # waiting RT requests by deadline
        self.be_waiting = PolledQueue()  # waiting BE requests by KV slots on the host
        self._rt_by_age = PolledQueue()  # every RT request, running or waiting, by seniority
        self._be_arrivals: dict[str, int] = {}  # every BE request's place in arrival order
        self.due = Deadlines()
        self._arrivals = itertools.count()

    # -- bookkeeping -------------------------------------------------------------------------
    def add(self, request: Request, host_slots: Callable[[Request], int]) -> None:
        """`request` joined the back of the waiting queue (`host_slots`: the KV manager's)."""
        if is_rt(request):
            self._rt_by_age.push(request, request.arrival_time, next(self._arrivals))
        else:
            self._be_arrivals[request.request_id] = next(self._arrivals)
        self._file(request, self._positions.back(), host_slots)

    def preempt(self, request: Request, host_slots: Callable[[Request], int]) -> None:
        """`request` went back to the head of the waiting queue."""
        self._file(request, self._positions.front(), host_slots)

    def admit(self, request: Request) -> None:
        """`request` left the waiting queue to run."""
        self._unfile(request)

    def finish(self, request: Request) -> None:
        """`request` left for good."""
        self._unfile(request)
        self._rt_by_age.discard(request)
        self._be_arrivals.pop(request.request_id, None)
        self.due.pop(request, None)

    def sampled(self, output: SchedulerOutput, now: float) -> None:
        """The step `output` ran, its tokens sampled at `now`: their RT requests' next deadlines."""
        for chunk in output.chunks:
            if chunk.samples and is_rt(chunk.request):
                self.due.sampled(chunk.request, now)

    def _file(self, request: Request, position: int, host_slots: Callable[[Request], int]) -> None:
        if is_rt(request):
            self.rt_waiting.push(request, self.due[request], position)
        else:
            self.be_waiting.push(request, host_slots(request), position)

    def _unfile(self, request: Request) -> None:
        (self.rt_waiting if is_rt(request) else self.be_waiting).discard(request)

    def sync(self, waiting: deque[Request], host_slots: Callable[[Request], int]) -> None:
        """Refile the waiting deque if something changed it behind the scheduler's back (a cheap
        count check; the normal paths above keep the two in step)."""
        if len(self.rt_waiting) + len(self.be_waiting) != len(waiting):
            self.rt_waiting, self.be_waiting = PolledQueue(), PolledQueue()
            for request in waiting:
                self._file(request, self._positions.back(), host_slots)

    def seniority(self, request: Request) -> tuple[float, int]:
        return self._rt_by_age.key(request) or (request.arrival_time, 0)

    # -- Alg. 1's orders -----------------------------------------------------------------------
    def rt_candidates(self, running: Iterable[Request],
                      waiting_closed: Callable[[], bool] = lambda: False) -> Generator[Request, None, None]:
        """Lines 3-4 with request pulling (Fig. 8): the running ("pending") RT requests sorted by
        deadline, polled against the waiting ones (pending first on ties). The oldest RT request
        goes first whatever its urgency: it may evict any other request, so it always advances,
        and requests that urgency alone orders cannot evict one another in a loop (a guarantee
        the paper leaves implicit; FCFS has it for its head). Once `waiting_closed()` holds, no
        more waiting requests are pulled (Alg. 1 stops adding RT requests when no block is left
        for them); the pending ones still come."""
        due = self.due
        pending = sorted([r for r in running if is_rt(r)], key=due.__getitem__)
        oldest = self._rt_by_age.first()
        if oldest is not None:
            yield oldest
        waiting = self.rt_waiting.pull()

        def pull() -> tuple | None:
            return None if waiting_closed() else next(waiting, None)

        try:
            head = pull()
            for request in pending:
                deadline = due[request]
                while head is not None and head[0] < deadline:
                    if head[1] is not oldest:
                        yield head[1]
                    head = pull()
                if request is not oldest:
                    yield request
            while head is not None:
                if head[1] is not oldest:
                    yield head[1]
                head = pull()
        finally:
            waiting.close()  # puts back the waiting requests not admitted

    def be_candidates(self, running: Iterable[Request],
                      host_positions: Callable[[], dict[str, int]]) -> Generator[Request, None, None]:
        """Line 17: BE requests by fewest KV slots on the host (their swap-in cost; `host_positions`
        is the KV manager's), running before waiting on ties, each in queue order. Only swapped
        or overwritten requests have host slots: the running ones among them are sorted, the rest
        polled. Ours, a livelock guard as for RT: the oldest running BE request goes first
        whatever its slots. It may evict every newer BE request (`_admit_be`), so it always
        advances; without it, two newer requests that each need the blocks the other holds took
        turns evicting each other while an older one with a slot on the host waited behind them
        forever (recomputed requests have no host slots, so line 17 puts them first)."""
        on_host = host_positions()
        running = [r for r in running if not is_rt(r)]
        if running:
            arrivals = self._be_arrivals
            oldest = min(running, key=lambda r: arrivals.get(r.request_id, -1))
            yield oldest
            running.remove(oldest)
        swapped: list[tuple[int, Request]] = []
        if on_host:
            swapped = sorted(((on_host[r.request_id], r) for r in running if r.request_id in on_host),
                             key=lambda pair: pair[0])
            running = [r for r in running if r.request_id not in on_host]
        yield from running
        waiting, i = self.be_waiting.pull(), 0
        try:
            for slots, request in waiting:
                while i < len(swapped) and swapped[i][0] <= slots:
                    yield swapped[i][1]
                    i += 1
                yield request
            for _, request in swapped[i:]:
                yield request
        finally:
            waiting.close()
