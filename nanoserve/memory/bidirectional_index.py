"""The records and indexes behind BROS's bidirectional block manager (bros.txt §5.2): the
preemption-table entry, a sequence's pages, the block index that lets placement skip scanning
the pool, and the host ledger used for what-if planning. `bidirectional_blocks.py` explains how
they are used and checks them in `check_invariants`.
"""
from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.host import KVCopy

SeqId = Hashable
PageKey = tuple[SeqId, int]  # (sequence, page index)
NOBODY: frozenset = frozenset()
FREE = ("free", 0)


@dataclass
class PreemptedPage:
    """A preemption-table entry: the positions of one page that are on the host, not the device."""

    block: int | None  # the page's device block; None when the whole page is swapped out
    host_slots: dict[int, int] = field(default_factory=dict)  # position -> flat host slot
    host_blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class DropResult:
    copies: tuple[KVCopy, ...]  # the saves that swap the sequence out
    recompute: bool  # the host had no room: the sequence was forgotten and must be recomputed


@dataclass
class SeqState:
    best_effort: bool
    num_tokens: int = 0
    pages: list[int | None] = field(default_factory=list)  # block per page; None when swapped out
    host_pages: set[int] = field(default_factory=set)  # pages with a preemption-table entry


def clone_entry(entry: PreemptedPage) -> PreemptedPage:
    return PreemptedPage(entry.block, dict(entry.host_slots), list(entry.host_blocks))


def clone_state(state: SeqState) -> SeqState:
    return SeqState(state.best_effort, state.num_tokens, list(state.pages), set(state.host_pages))


_MISSING = object()  # a CopyOnRead key the twin popped: hidden from it, still in the real table
_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


class CopyOnRead(Generic[_K, _V]):
    """A what-if twin's view of a table of mutable records (`BidirectionalBlocks.what_if`): an
    overlay on the real table, which it never changes. A record is cloned into the overlay the
    first time the twin reads it by key, so a trial mutates only copies; keys the twin sets or
    pops live in the overlay too. A trial reads a handful of records, so neither copying every
    record (`copy.deepcopy` cost BROS ~60 ms a question at a few hundred sequences) nor even the
    table itself (a dict copy per question was 30% of a BROS simulation once a large host store
    held thousands of swapped-out pages) is paid. The real table must not change while the twin
    is in use (`can_grow` makes one, asks, and drops it)."""

    __slots__ = ("_base", "_clone", "_own")
    _base: dict[_K, _V]
    _clone: Callable[[_V], _V]
    _own: dict[_K, Any]  # the twin's records, and _MISSING for the keys it popped

    def __init__(self, table: dict[_K, _V], clone: Callable[[_V], _V]) -> None:
        self._base, self._clone, self._own = table, clone, {}

    def _read(self, key: _K) -> Any:
        """The twin's record under `key` (cloned on first read), or _MISSING."""
        own = self._own
        if key in own:
            return own[key]
        if key in self._base:
            value = own[key] = self._clone(self._base[key])
            return value
        return _MISSING

    def __getitem__(self, key: _K) -> _V:
        value = self._read(key)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __setitem__(self, key: _K, value: _V) -> None:
        self._own[key] = value

    def __contains__(self, key: object) -> bool:
        own = self._own
        return own[key] is not _MISSING if key in own else key in self._base

    def get(self, key: _K, default: _V | None = None) -> _V | None:
        value = self._read(key)
        return default if value is _MISSING else value

    def setdefault(self, key: _K, default: _V | None = None) -> _V | None:
        value = self._read(key)
        if value is _MISSING:
            value = self._own[key] = default
        return value

    def pop(self, key: _K, *default: Any) -> Any:
        value = self._read(key)
        if value is _MISSING:
            if default:
                return default[0]
            raise KeyError(key)
        self._own[key] = _MISSING
        return value

    def items(self) -> Iterator[tuple[_K, _V]]:
        """The twin's view (no cloning: read-only checks iterate)."""
        own = self._own
        for key, value in self._base.items():
            if key not in own:
                yield key, value
        for key, value in own.items():
            if value is not _MISSING:
                yield key, value

    def keys(self) -> Iterator[_K]:
        return (key for key, _ in self.items())

    def values(self) -> Iterator[_V]:
        return (value for _, value in self.items())

    def __iter__(self) -> Iterator[_K]:
        return self.keys()

    def __len__(self) -> int:
        own = self._own
        return (len(self._base) - sum(1 for key in own if key in self._base)
                + sum(1 for value in own.values() if value is not _MISSING))


class HostLedger:
    """Stands in for the host store in a what-if copy of the manager (`can_grow`): it counts free
    blocks and holds no tensors. Its ids start past the real store's, so none collides."""

    def __init__(self, num_free_blocks: int, block_size: int, first_id: int):
        self.num_free_blocks, self.block_size, self._next = num_free_blocks, block_size, first_id

    def allocate(self, owner: Hashable, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError("what-if host store is full")
        self.num_free_blocks -= num_blocks
        self._next += num_blocks
        return list(range(self._next - num_blocks, self._next))

    def free(self, owner: Hashable, blocks: list[int]) -> None:
        self.num_free_blocks += len(blocks)

    def slots(self, host_block: int, count: int | None = None) -> list[int]:
        start = host_block * self.block_size
        return list(range(start, start + (self.block_size if count is None else count)))


class BlockIndex:
    """Each block filed under one key (see the module docstring); a heap may hold stale entries."""

    def __init__(self, num_blocks: int):
        self.key: list[tuple | None] = [FREE] * num_blocks
        self.heaps: dict[tuple, list[int]] = defaultdict(list, {FREE: list(range(num_blocks))})
        self.sizes: Counter[tuple | None] = Counter({FREE: num_blocks})  # blocks per key

    def copy(self) -> BlockIndex:
        twin = BlockIndex.__new__(BlockIndex)
        twin.key = list(self.key)
        twin.heaps = defaultdict(list, {key: list(heap) for key, heap in self.heaps.items()})
        twin.sizes = Counter(self.sizes)
        return twin

    def put(self, block: int, key: tuple | None) -> None:
        old = self.key[block]
        if old != key:
            self.key[block] = key
            self.sizes[old] -= 1
            self.sizes[key] += 1
            if key is not None:
                heapq.heappush(heap := self.heaps[key], block)
                if len(heap) > 2 * self.sizes[key] + 32:  # mostly stale: keep the live entries
                    heap[:] = sorted({b for b in heap if self.key[b] == key})

    def first(self, key: tuple, count: int, ok: Callable[[int], bool]) -> list[int]:
        """Up to `count` blocks under `key` that pass `ok`, lowest id first. The heap is popped to
        be read and its live entries pushed back, so nothing visible changes."""
        heap = self.heaps[key]
        found: list[int] = []
        seen: list[int] = []
        while heap and len(found) < count:
            block = heapq.heappop(heap)
            if self.key[block] == key and not (seen and seen[-1] == block):  # skip stale, duplicates
                seen.append(block)
                found += [block] if ok(block) else []
        for block in seen:
            heapq.heappush(heap, block)
        return found
