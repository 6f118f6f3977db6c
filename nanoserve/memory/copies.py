"""KV copies between device and host, and the ledger of those still in flight.

A memory manager plans copies; an executor runs them beside the forward pass. What a copy is
and who waits for it:

    kind    from -> to        who waits for it
    save    device -> host    nobody, normally: a checkpoint (ConServe §4.4) runs under later
                              forwards. `blocking` when this very step overwrites its source
                              (BROS's lazy checkpoint of slots an RT page takes, §5.2; EcoServe
                              evicting a guest whose host takes its region back, §3.4; vLLM's
                              swap-out, whose freed blocks the step hands on at once)
    load    host -> device    the forward that runs `reader`: issued with it, or steps ahead
                              (a prefetch, ConServe §4.4), it blocks only the step whose batch
                              holds its reader
    move    device -> device  as a load (BROS moves a page's surviving slots to a new block)

One copy stream (the runner's) and one link (the simulator's) carry every copy, in the order
the copies were issued:

    step n:   issue ──► [save a][load b][save c] ──────────────► copy stream / PCIe link
              forward n waits for: blocking copies of step n, loads whose reader is in batch n
    step n+1: the manager polls: a, b landed ──► a's source blocks may be reused, a's host copy
              may be read; c is still in flight, so its source stays out of everyone's reach

So copies never overtake each other; only the forward on the compute stream can race them.
The rules that keep it from doing so are the managers': a device block that an in-flight copy
reads or writes is not handed to another request until the copy has landed (`when_landed`
tells the manager when), and a host copy is not read (loaded) before its save has landed.

`InflightCopies` is the ledger both sides share: the executor `issue`s each copy with a probe
that says whether it has landed (a CUDA event's query, "now" on a CPU, virtual time in the
simulator, the test's say-so in the state machines); the manager `poll`s it at the start of
every step and learns, in issue order, what landed since, running the actions it registered.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

_tickets = itertools.count()
# The order a group's copies run in: saves first, so one step can checkpoint a slot, then refill it.
ISSUE_ORDER = ("save", "move", "load")


@dataclass(frozen=True)
class KVCopy:
    """Copy every layer's K/V from slots `src` to slots `dst`, pairwise in order.

    Device slots are `block * B + slot` (the runner's slot mapping), host slots
    `host_block * B + i`. `ticket` names the copy across processes (tensor-parallel ranks run
    the same copies): unique per planning process, drawn when the copy is made.
    """

    kind: Literal["save", "move", "load"]
    src: tuple[int, ...]
    dst: tuple[int, ...]
    # The request whose forward reads `dst` (a load or move): that forward waits for the copy.
    reader: Hashable | None = None
    # The step that issues the copy waits for it before its forward, whatever that step runs.
    blocking: bool = False
    ticket: int = field(default_factory=lambda: next(_tickets), compare=False)

    def __post_init__(self) -> None:
        if self.kind not in ISSUE_ORDER:
            raise ValueError(f"unknown copy kind {self.kind!r}")
        if len(self.src) != len(self.dst):
            raise ValueError("a KV copy pairs source and destination slots one to one")

    def needed_by(self, readers: Iterable[Hashable] | set) -> bool:
        """Must a forward over requests `readers`, in the step that issues this copy, wait for it?
        A load or move that names no reader is conservatively waited for."""
        if self.blocking or (self.kind != "save" and self.reader is None):
            return True
        return self.reader is not None and self.reader in readers


def device_slots(blocks: Iterable[int], block_size: int) -> tuple[int, ...]:
    """Every flat device slot of `blocks`, block by block: the device side of a whole-block copy
    (`HostKVStore.slots_of` is the host side)."""
    return tuple(b * block_size + i for b in blocks for i in range(block_size))


def _landed_now() -> bool:
    return True


LANDED_NOW: Callable[[], bool] = _landed_now  # the probe of a copy that ran synchronously


@dataclass
class _InFlight:
    copy: KVCopy
    landed: Callable[[], bool]
    handle: Any = None  # what an executor waits on (a CUDA event); None where nothing can wait


class InflightCopies:
    """Issued copies not yet seen to land, in issue order, and what to do when each lands.

    Invariant (checked by `check_invariants`): a ticket is in flight at most once, filed under
    its own number.
    """

    def __init__(self) -> None:
        self._inflight: dict[int, _InFlight] = {}  # insertion order == issue order
        self._actions: dict[int, list[Callable[[], None]]] = {}

    # -- the executor's side -----------------------------------------------------------------
    def issue(self, copy: KVCopy, landed: Callable[[], bool], handle: Any = None) -> None:
        if copy.ticket in self._inflight:
            raise ValueError(f"copy {copy.ticket} was issued twice")
        self._inflight[copy.ticket] = _InFlight(copy, landed, handle)

    def pending(self) -> list[KVCopy]:
        """Copies issued and not yet reported landed, in issue order."""
        return [f.copy for f in self._inflight.values()]

    def handles(self, needed: Callable[[KVCopy], bool]) -> list[Any]:
        """The distinct wait handles of in-flight copies for which `needed(copy)` holds."""
        seen: dict[int, Any] = {}
        for f in self._inflight.values():
            if f.handle is not None and needed(f.copy):
                seen.setdefault(id(f.handle), f.handle)
        return list(seen.values())

    def forget(self, tickets: Iterable[int]) -> list[Any]:
        """Drop `tickets` (another process's manager saw them land); returns their wait handles,
        which the caller makes its streams wait on before anything may reuse what they touched."""
        handles: dict[int, Any] = {}
        for ticket in tickets:
            f = self._inflight.pop(ticket, None)
            if f is not None and f.handle is not None:
                handles.setdefault(id(f.handle), f.handle)
        return list(handles.values())

    # -- the manager's side ------------------------------------------------------------------
    def is_in_flight(self, copy: KVCopy) -> bool:
        return copy.ticket in self._inflight

    def when_landed(self, copy: KVCopy, action: Callable[[], None]) -> None:
        """Run `action` at the poll that reports `copy` landed. Register it while the copy is
        planned or in flight (a manager knows which of its copies a poll already reported)."""
        self._actions.setdefault(copy.ticket, []).append(action)

    def poll(self) -> list[KVCopy]:
        """Copies that landed since the last poll, in issue order; their actions run first."""
        done = [f.copy for f in self._inflight.values() if f.landed()]
        for copy in done:
            del self._inflight[copy.ticket]
            for action in self._actions.pop(copy.ticket, ()):
                action()
        return done

    def check_invariants(self) -> None:
        for ticket, f in self._inflight.items():
            assert f.copy.ticket == ticket, "a copy is filed under another's ticket"
