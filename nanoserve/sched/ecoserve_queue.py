"""EcoServe's waiting queues, the prompt queue Q_P and the GT queue Q_G (ecoserve.txt §3.3), indexed
so that a step costs what changed, not what waits.

§3.3 orders waiting tasks by (deadline bucket, -occupied-KV bucket, -length, arrival), the length
being the predicted RL for GTs and the prompt length for PTs. While a task waits, all of that is
fixed but the deadline bucket: the deadline of its next token is
fixed, its slack shrinks as time passes, so its bucket only ever moves to more urgent ones. The
queue therefore keeps
- one list per (deadline bucket, -occupied bucket) group, sorted by the rest of the key: what the
  admission bisect searches (`closest_below`);
- for each finite deadline bucket a request can still leave (all but the most urgent), its members
  sorted by deadline: `advance(now)` moves just the prefix whose slack crossed a bound.
Adding or removing a request is a bisect and a list insert or delete; nothing is re-sorted.

Ties on the whole key keep the order of the scheduler's waiting deque (new requests at the back,
preempted ones at the front), as the stable sort of that deque did: `add(..., at_front=...)`.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Hashable
from dataclasses import dataclass

from nanoserve.request import Request

Group = tuple[int, int]  # (deadline bucket, -occupied-KV bucket): ascending is §3.3's order
Rank = tuple[int, float, int]  # (-length, arrival time, deque position) inside a group


def deadline_bucket(slack: float, bounds: tuple[float, ...]) -> int:
    """§3.3's slack ranges: 0 below bounds[0], ..., len(bounds) past the last, one more: no target."""
    return len(bounds) + 1 if math.isinf(slack) else bisect_right(bounds, slack)


@dataclass(eq=False, slots=True)
class _Entry:
    request: Request
    deadline: float  # of the request's next token; inf: no target
    neg_occupied: int
    rank: Rank
    group: Group = (0, 0)  # where it sits as of the queue's `now`


class TaskQueue:
    def __init__(self, deadline_bounds: tuple[float, ...]):
        self.bounds = deadline_bounds
        self.now = -math.inf  # until the first `advance`, every slack reads as no target
        self._entries: dict[Hashable, _Entry] = {}  # by request id
        self._groups: dict[Group, list[tuple]] = {}  # rank + (request,), ascending
        # Deadline bucket -> (deadline, position, request id), ascending; only the buckets a
        # request can still leave: 1..len(bounds) (0 is the most urgent, len + 1 has no deadline).
        self._by_deadline: dict[int, list[tuple[float, int, Hashable]]] = {
            bucket: [] for bucket in range(1, len(deadline_bounds) + 1)}
        self._front = self._back = 0  # deque positions handed out at either end

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request: Request) -> bool:
        entry = self._entries.get(request.request_id)
        return entry is not None and entry.request is request

    def add(self, request: Request, *, deadline: float, occupied_bucket: int, length: int,
            at_front: bool = False) -> None:
        """Queue `request` with the static parts of its §3.3 key; `at_front` as deque.appendleft."""
        if request.request_id in self._entries:
            raise ValueError(f"{request.request_id!r} is already queued")
        if at_front:
            self._front -= 1
            position = self._front
        else:
            position = self._back
            self._back += 1
        entry = _Entry(request, deadline, -occupied_bucket, (-length, request.arrival_time, position))
        self._entries[request.request_id] = entry
        self._place(entry)

    def remove(self, request: Request) -> None:
        entry = self._entries.pop(request.request_id)
        self._unplace(entry)

    def advance(self, now: float) -> None:
        """Move every request whose slack at `now` fell into a more urgent deadline bucket."""
        if now < self.now or self.now == -math.inf:  # the first call, or a clock that went back: place all anew
            for entry in self._entries.values():
                self._unplace(entry)
            self.now = now
            for entry in self._entries.values():
                self._place(entry)
            return
        self.now = now
        for bucket, members in self._by_deadline.items():
            # Slack falls with the deadline, so the movers are a prefix of the deadline order.
            moved = 0
            while moved < len(members) and deadline_bucket(members[moved][0] - now, self.bounds) < bucket:
                moved += 1
            if moved:
                movers = [self._entries[rid] for _, _, rid in members[:moved]]
                del members[:moved]
                for entry in movers:
                    self._unplace_from_group(entry)
                    self._place(entry)

    def requests(self) -> list[Request]:
        """Every queued request, in no particular order."""
        return [entry.request for entry in self._entries.values()]

    def groups(self) -> list[Group]:
        """The non-empty groups, most urgent first (§3.3)."""
        return sorted(group for group, members in self._groups.items() if members)

    def members(self, group: Group) -> list[Request]:
        """The group's requests, longest first: the order `closest_below` searches."""
        return [item[-1] for item in self._groups.get(group, ())]

    def closest_below(self, group: Group, room: int, skip: set[Request]) -> Request | None:
        """The group's first request (by rank) whose length is at most `room`, else its last
        (the shortest): §3.3's bisect. Requests in `skip` are passed over as if gone."""
        members = self._groups.get(group)
        if not members:
            return None
        for i in range(bisect_left(members, (-room,)), len(members)):
            if members[i][-1] not in skip:
                return members[i][-1]
        for i in range(len(members) - 1, -1, -1):
            if members[i][-1] not in skip:
                return members[i][-1]
        return None

    # -- placement ---------------------------------------------------------------------------
    def _place(self, entry: _Entry) -> None:
        bucket = deadline_bucket(entry.deadline - self.now, self.bounds)
        entry.group = (bucket, entry.neg_occupied)
        insort(self._groups.setdefault(entry.group, []), entry.rank + (entry.request,))
        if bucket in self._by_deadline:
            insort(self._by_deadline[bucket], (entry.deadline, entry.rank[2], entry.request.request_id))

    def _unplace(self, entry: _Entry) -> None:
        self._unplace_from_group(entry)
        members = self._by_deadline.get(entry.group[0])
        if members is not None:
            del members[bisect_left(members, (entry.deadline, entry.rank[2]))]

    def _unplace_from_group(self, entry: _Entry) -> None:
        members = self._groups[entry.group]
        # Ranks are unique (the deque position), so the rank alone finds the item.
        del members[bisect_left(members, entry.rank)]
        if not members:
            del self._groups[entry.group]
