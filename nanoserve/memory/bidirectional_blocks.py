"""Bookkeeping of BROS's bidirectional KV blocks (bros.txt §5.1 block structure, §5.2 preemption
table): who holds which side of which block, which positions sit on the host, the slot
arithmetic, and the invariants. Placement, checkpoints and restores, which plan and return
copies, are in `nanoserve/memory/bidirectional.py`; `HostLedger` serves its what-if planning.

A block of B slots serves at most one real-time (RT) page, filling slots 0, 1, ... left to right,
and one best-effort (BE) page, filling slots B-1, B-2, ... right to left. Position p of a
sequence lives in block `table[p // B]` at slot `p % B` (RT) or `B - 1 - p % B` (BE), the layout
the attention kernels read with `directions[s] = is_best_effort(s)`; positions [i*B, i*B + B)
form page i, and a page sits in one block. `preemption_table[(seq, page)]` records which
positions of a page are on the host, and in which host slots.

Invariants (checked by `check_invariants`):
  1. Conservation: a block is free or holds on-device pages; free + used == total, a shared
     block counted once. Each block side names the (seq, page) whose table points at it.
  2. A block holds at most one RT page (left) and one BE page (right); the RT fill [0, f) never
     meets a BE slot on the device, so every slot has at most one owner.
  3. A sequence of n positions has ceil(n / B) pages, each on the device or swapped out.
  4. Preemption table: an entry's positions lie in its page; its block is the page's (None when
     swapped out, and then the whole page is on the host); only BE pages lose single slots; host
     slots are distinct, packed in ceil(k / B) host blocks, and each sequence owns in the store
     exactly the host blocks of its entries.
  5. With no sequences, every block is free and the preemption table is empty.
  6. The indexes below agree with the blocks and the preemption table.

Indexes, so that placement never scans the pool. `BlockIndex` files each block under FREE,
("rt", fill) (an RT page alone, not full), ("be", n) (a BE page alone, n positions on the device)
or None (no page can join), each key a min-heap of block ids with lazy deletion. FindBlock reads
FREE, ("rt", 1), ("rt", 2), ...; FindPreemptBlock FREE, ("be", 0), ("be", 1), ...: the order of a
full sort, ties to the lowest id. Mutations `_reindex` the blocks they touch, but a page growing
in place (most decode steps) only marks its block `_stale`: `_refresh` refiles those before any
key but FREE is read. `SeqState.host_pages` names a sequence's pages in the preemption table.
"""
from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Hashable

from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.host import HostKVStore, KVCopy

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
        self.sizes = Counter({FREE: num_blocks})  # blocks per key

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

    def first(self, key: tuple, count: int, ok) -> list[int]:
        """Up to `count` blocks under `key` that pass `ok`, lowest id first. The heap is popped to
        be read and its live entries pushed back, so nothing visible changes."""
        heap, found, seen = self.heaps[key], [], []
        while heap and len(found) < count:
            block = heapq.heappop(heap)
            if self.key[block] == key and not (seen and seen[-1] == block):  # skip stale, duplicates
                seen.append(block)
                found += [block] if ok(block) else []
        for block in seen:
            heapq.heappush(heap, block)
        return found


class BidirectionalBlocks:
    """The state of a bidirectional block pool and the questions that only read it."""

    def __init__(self, num_blocks: int, block_size: int, host: HostKVStore):
        if num_blocks < 1 or block_size < 1 or host.block_size != block_size:
            raise ValueError("need positive sizes and a host store with the same block size")
        self.num_blocks, self.block_size, self.host = num_blocks, block_size, host
        self._rt: list[PageKey | None] = [None] * num_blocks  # the page on each block's left side
        self._be: list[PageKey | None] = [None] * num_blocks  # the page on each block's right side
        self._seqs: dict[SeqId, SeqState] = {}
        self.preemption_table: dict[PageKey, PreemptedPage] = {}
        self._index = BlockIndex(num_blocks)
        self._stale: set[int] = set()  # blocks whose fill grew in place since their key was filed
        # Sequences whose device slots this step's forward pass reads: an RT page may not
        # overwrite them. The caller (the KVManager adapter) fills it and clears it each step.
        self.pinned: set[SeqId] = set()
        # Event counters, so callers and tests can see which mechanism ran.
        self.preemptions = 0  # RT pages placed on a block with a live BE page
        self.overwrites = 0  # BE pages that lost slots to an RT page
        self.checkpointed_slots = 0  # BE slots saved just before an RT page overwrote them
        self.restored_pages = self.relocated_pages = self.swap_outs = self.recomputes = 0

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._index.sizes[FREE]

    def has(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def is_best_effort(self, seq_id: SeqId) -> bool:
        return self._seqs[seq_id].best_effort

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._seqs[seq_id].num_tokens

    def block_table(self, seq_id: SeqId) -> list[int]:
        pages = self._seqs[seq_id].pages
        if None in pages:
            raise ValueError(f"{seq_id!r} is swapped out; call ensure_resident first")
        return list(pages)  # type: ignore[arg-type]

    def missing_positions(self, seq_id: SeqId) -> list[int]:
        """Positions whose KV is on the host, not the device: `ensure_resident` brings them back."""
        state = self._seqs.get(seq_id)
        pages = state.host_pages if state else ()
        return sorted(p for page in pages for p in self.preemption_table[(seq_id, page)].host_slots)

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Flat device slots of positions [start, end), in the sequence's direction."""
        if end > self._seqs[seq_id].num_tokens:
            raise IndexError(f"positions up to {end} exceed the {self._seqs[seq_id].num_tokens} allocated")
        return [self._device_slot(seq_id, p) for p in range(start, end)]

    def free(self, seq_id: SeqId) -> None:
        """Release every device and host block of `seq_id`. Freeing an unknown id is a no-op."""
        state = self._seqs.pop(seq_id, None)
        self.pinned.discard(seq_id)
        if state is None:
            return
        sides = self._be if state.best_effort else self._rt
        for page, block in enumerate(state.pages):
            entry = self.preemption_table.pop((seq_id, page), None)
            if entry is not None:
                self.host.free(seq_id, entry.host_blocks)
            if block is not None:
                sides[block] = None
                self._reindex(block)

    def _key(self, block: int) -> tuple | None:
        """The block's key in the index, worked out from the blocks."""
        rt, be = self._rt[block], self._be[block]
        if be is None:
            fill = self._fill(*rt) if rt else 0
            return FREE if rt is None else ("rt", fill) if fill < self.block_size else None
        return ("be", len(self._resident(*be))) if rt is None else None

    def _reindex(self, *blocks: int | None) -> None:
        for block in blocks:
            if block is not None:
                self._index.put(block, self._key(block))

    def _refresh(self) -> None:
        self._reindex(*self._stale)
        self._stale.clear()

    # -- slot arithmetic -----------------------------------------------------------------
    def _slot_in(self, block: int, best_effort: bool, position: int) -> int:
        offset = position % self.block_size
        return block * self.block_size + (self.block_size - 1 - offset if best_effort else offset)

    def _device_slot(self, seq_id: SeqId, position: int) -> int:
        state = self._seqs[seq_id]
        block = state.pages[position // self.block_size]
        if block is None:
            raise ValueError(f"position {position} of {seq_id!r} is swapped out")
        return self._slot_in(block, state.best_effort, position)

    def _fill_at(self, num_tokens: int, page: int) -> int:
        """How many positions page `page` holds in a sequence of `num_tokens`."""
        return max(0, min(self.block_size, num_tokens - page * self.block_size))

    def _fill(self, seq_id: SeqId, page: int) -> int:
        return self._fill_at(self._seqs[seq_id].num_tokens, page)

    def _rt_fill(self, block: int) -> int:
        owner = self._rt[block]
        return 0 if owner is None else self._fill(*owner)

    def _resident(self, seq_id: SeqId, page: int) -> list[int]:
        """Positions of `page` whose KV is on the device."""
        if self._seqs[seq_id].pages[page] is None:
            return []
        lost = self.preemption_table.get((seq_id, page))
        start = page * self.block_size
        return [p for p in range(start, start + self._fill(seq_id, page)) if lost is None or p not in lost.host_slots]

    def _live_be(self, block: int, gone: frozenset) -> PageKey | None:
        owner = self._be[block]
        return None if owner is None or owner[0] in gone else owner

    def _be_positions_under(self, block: int, gone: frozenset, lo: int = 0, hi: int | None = None
                            ) -> list[tuple[PageKey, int]]:
        """The block's on-device BE positions in slots [lo, hi): what an RT fill there overwrites."""
        owner, hi = self._live_be(block, gone), self.block_size if hi is None else hi
        in_range = [p for p in self._resident(*owner) if lo <= self._slot_in(0, True, p) < hi] if owner else []
        return [(owner, p) for p in in_range]

    def _spare_host_slots(self, entry: PreemptedPage) -> list[int]:
        used = set(entry.host_slots.values())
        return [s for b in entry.host_blocks for s in self.host.slots(b) if s not in used]

    def _host_blocks_needed(self, saves: list[tuple[PageKey, int]]) -> int:
        need = 0
        for key, count in Counter(key for key, _ in saves).items():
            spare = len(self._spare_host_slots(self.preemption_table[key])) if key in self.preemption_table else 0
            need += max(0, -(-(count - spare) // self.block_size))
        return need

    # -- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        B, used, slot_owner, host_owned = self.block_size, set(), {}, defaultdict(list)
        for sides, best_effort in ((self._rt, False), (self._be, True)):
            for block, (seq_id, page) in ((b, o) for b, o in enumerate(sides) if o is not None):
                state = self._seqs.get(seq_id)
                assert state and state.best_effort == best_effort, f"block {block}: {seq_id!r} on the wrong side"
                assert state.pages[page] == block, f"block {block} names {seq_id!r} page {page}, which is elsewhere"
        for seq_id, state in self._seqs.items():
            assert len(state.pages) == -(-state.num_tokens // B), f"{seq_id!r}: table size != positions"
            for page, block in enumerate(state.pages):
                if block is None:
                    assert (seq_id, page) in self.preemption_table, f"{seq_id!r} page {page}: off device, no record"
                    continue
                assert (self._be if state.best_effort else self._rt)[block] == (seq_id, page), f"{seq_id!r} page {page}"
                used.add(block)
                for position in self._resident(seq_id, page):
                    slot = self._slot_in(block, state.best_effort, position)
                    assert slot not in slot_owner, f"slot {slot}: {slot_owner.get(slot)} and {seq_id!r}"
                    slot_owner[slot] = (seq_id, position)
        for block in range(self.num_blocks):
            assert not self._be_positions_under(block, NOBODY, 0, self._rt_fill(block)), f"block {block}: RT meets BE"
        free = sum(rt is None and be is None for rt, be in zip(self._rt, self._be))
        assert free == self.num_free_blocks and free + len(used) == self.num_blocks, "blocks lost or invented"
        index = self._index
        assert all(k == self._key(b) or (b in self._stale and FREE not in (k, self._key(b)))
                   for b, k in enumerate(index.key)), "index key out of date"
        assert +index.sizes == +Counter(index.key), "index sizes out of date"
        for key, heap in index.heaps.items():
            assert {b for b, k in enumerate(index.key) if k == key} <= set(heap), f"{key}: heap lost a block"
        for (seq_id, page), entry in self.preemption_table.items():
            state, slots = self._seqs[seq_id], list(entry.host_slots.values())
            positions = set(range(page * B, page * B + self._fill(seq_id, page)))
            assert entry.host_slots and set(entry.host_slots) <= positions, f"{seq_id!r} page {page}: bad entry"
            assert entry.block == state.pages[page], f"{seq_id!r} page {page}: entry names the wrong block"
            assert entry.block is not None or set(entry.host_slots) == positions, "swapped-out page not all on host"
            assert entry.block is None or state.best_effort, "only BE pages lose single slots"
            assert len(set(slots)) == len(slots), "two positions share a host slot"
            assert set(slots) <= {s for b in entry.host_blocks for s in self.host.slots(b)}, "host slot outside entry"
            assert len(entry.host_blocks) == -(-len(slots) // B), "host blocks not packed"
            host_owned[seq_id] += entry.host_blocks
            assert page in state.host_pages, f"{seq_id!r} page {page}: entry not in host_pages"
        for seq_id, state in self._seqs.items():
            assert sorted(self.host.blocks_of(seq_id)) == sorted(host_owned[seq_id]), f"{seq_id!r}: host blocks leak"
            assert all((seq_id, p) in self.preemption_table for p in state.host_pages), f"{seq_id!r}: host_pages"
        assert self.pinned <= set(self._seqs), "a pinned sequence is unknown"
        self.host.check_invariants()
        if not self._seqs:
            assert self.num_free_blocks == self.num_blocks and not self.preemption_table, "leak after free"
