"""The state of BROS's bidirectional block pool (bros.txt §5.1 block structure, §5.2 preemption
table): who holds which side of which block, which positions sit on the host, the slot
arithmetic, the block index's upkeep, and the invariants. `BidirectionalBlockManager`
(`bidirectional.py`) owns one and is the only one to change it, through its helpers
`FastGrowth` (`bidirectional_growth.py`) and `Placement` (`bidirectional_placement.py`, the
read-only FindBlock / FindPreemptBlock searches); the records and indexes are in
`bidirectional_index.py`.

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
full sort, ties to the lowest id. Mutations `reindex` the blocks they touch, but a page growing
in place (most decode steps) only marks its block `stale`: `refresh` refiles those before any
key but FREE is read. `SeqState.host_pages` names a sequence's pages in the preemption table.
"""
from __future__ import annotations

import copy
from collections import Counter, defaultdict
from typing import cast

from nanoserve.memory.bidirectional_index import (
    FREE,
    NOBODY,
    BlockIndex,
    CopyOnRead,
    HostLedger,
    PageKey,
    PreemptedPage,
    SeqId,
    SeqState,
    clone_entry,
    clone_state,
)
from nanoserve.memory.host import HostKVStore


class BidirectionalBlocks:
    """The state of a bidirectional block pool and the questions that only read it.

    Its interface is these attributes, which the manager and its helpers read, and which the
    manager's mutations (and `FastGrowth`'s, on the manager's behalf) change in place:

        rt, be              the (seq, page) on each block's left (RT) / right (BE) side, or None
        seqs                each sequence's `SeqState`
        preemption_table    each (seq, page) with positions on the host: its `PreemptedPage`
        index               the `BlockIndex` (module docstring); `refresh` before reading a key
                            other than FREE
        stale               blocks whose fill grew in place since their key was filed
        pinned              sequences this step's forward pass reads (never overwritten by RT)
        generation          bumped by every mutation (`changed`), so an answer can be
                            remembered until the state changes
        host                the host store (or, in a what-if copy, a `HostLedger`)

    A mutation calls `changed` first, and afterwards refiles the blocks whose key it changed
    (`reindex`) or marks those whose fill only grew (`stale`).
    """

    def __init__(self, num_blocks: int, block_size: int, host: HostKVStore) -> None:
        if num_blocks < 1 or block_size < 1 or host.block_size != block_size:
            raise ValueError("need positive sizes and a host store with the same block size")
        self.num_blocks, self.block_size, self.host = num_blocks, block_size, host
        self.rt: list[PageKey | None] = [None] * num_blocks  # the page on each block's left side
        self.be: list[PageKey | None] = [None] * num_blocks  # the page on each block's right side
        self.seqs: dict[SeqId, SeqState] = {}
        self.preemption_table: dict[PageKey, PreemptedPage] = {}
        self.index = BlockIndex(num_blocks)
        self.stale: set[int] = set()  # blocks whose fill grew in place since their key was filed
        # Sequences whose device slots this step's forward pass reads: an RT page may not
        # overwrite them. The caller (the KVManager adapter) fills it and clears it each step.
        self.pinned: set[SeqId] = set()
        # Bumped by every mutation, so an answer can be remembered until the state changes.
        self.generation = 0

    def what_if(self, host: HostKVStore | HostLedger) -> BidirectionalBlocks:
        """A throwaway copy to try a mutation on, over `host` (a ledger, not the store): the flat
        lists and indexes are copied, each sequence's state and preemption-table entry only when
        the trial reads it (`CopyOnRead`). `copy.deepcopy`, which walked every record, cost BROS
        ~60 ms a question at a few hundred sequences."""
        twin = copy.copy(self)
        twin.host = cast(HostKVStore, host)  # a ledger stands in: a trial uses only what both offer
        twin.rt, twin.be = list(self.rt), list(self.be)
        # Overlays that read and write like the dicts they stand for: a trial uses only what both offer.
        twin.seqs = cast("dict[SeqId, SeqState]", CopyOnRead(self.seqs, clone_state))
        twin.preemption_table = cast("dict[PageKey, PreemptedPage]", CopyOnRead(self.preemption_table, clone_entry))
        twin.index = self.index.copy()
        twin.stale, twin.pinned = set(self.stale), set(self.pinned)
        return twin

    def changed(self) -> None:
        """A mutation begins: answers remembered against `generation` no longer hold."""
        self.generation += 1

    def sides(self, best_effort: bool) -> list[PageKey | None]:
        """The side of every block that pages of this class take: `be` or `rt`."""
        return self.be if best_effort else self.rt

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.index.sizes[FREE]

    def has(self, seq_id: SeqId) -> bool:
        return seq_id in self.seqs

    def is_best_effort(self, seq_id: SeqId) -> bool:
        return self.seqs[seq_id].best_effort

    def num_tokens(self, seq_id: SeqId) -> int:
        return self.seqs[seq_id].num_tokens

    def block_table(self, seq_id: SeqId) -> list[int]:
        state = self.seqs[seq_id]
        pages = state.pages
        if state.host_pages and None in pages:  # only a page in the preemption table can be off the device
            raise ValueError(f"{seq_id!r} is swapped out; call ensure_resident first")
        return list(pages)  # type: ignore[arg-type]

    def missing_positions(self, seq_id: SeqId) -> list[int]:
        """Positions whose KV is on the host, not the device: `ensure_resident` brings them back."""
        state = self.seqs.get(seq_id)
        pages = state.host_pages if state else ()
        return sorted(p for page in pages for p in self.preemption_table[(seq_id, page)].host_slots)

    def host_positions(self) -> dict[SeqId, int]:
        """How many positions (`missing_positions`) each sequence with any has on the host. Reads
        only the preemption table, so it costs nothing while nobody is checkpointed or swapped."""
        counts: dict[SeqId, int] = defaultdict(int)
        for (seq_id, _), entry in self.preemption_table.items():
            counts[seq_id] += len(entry.host_slots)
        return counts

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Flat device slots of positions [start, end), in the sequence's direction."""
        if end > self.seqs[seq_id].num_tokens:
            raise IndexError(f"positions up to {end} exceed the {self.seqs[seq_id].num_tokens} allocated")
        return [self.device_slot(seq_id, p) for p in range(start, end)]

    def free(self, seq_id: SeqId) -> None:
        """Release every device and host block of `seq_id`. Freeing an unknown id is a no-op."""
        self.changed()
        state = self.seqs.pop(seq_id, None)
        self.pinned.discard(seq_id)
        if state is None:
            return
        sides = self.sides(state.best_effort)
        for page, block in enumerate(state.pages):
            entry = self.preemption_table.pop((seq_id, page), None)
            if entry is not None:
                self.host.free(seq_id, entry.host_blocks)
            if block is not None:
                sides[block] = None
                self.reindex(block)

    # -- the index's upkeep ----------------------------------------------------------------
    def key(self, block: int) -> tuple | None:
        """The block's key in the index, worked out from the blocks."""
        rt, be = self.rt[block], self.be[block]
        if be is None:
            fill = self.fill(*rt) if rt else 0
            return FREE if rt is None else ("rt", fill) if fill < self.block_size else None
        return ("be", len(self.resident(*be))) if rt is None else None

    def reindex(self, *blocks: int | None) -> None:
        """Refile `blocks` (None entries skipped) under their keys as the blocks now stand."""
        for block in blocks:
            if block is not None:
                self.index.put(block, self.key(block))

    def refresh(self) -> None:
        """Refile the `stale` blocks: every key is current afterwards."""
        self.reindex(*self.stale)
        self.stale.clear()

    # -- slot arithmetic -----------------------------------------------------------------
    def slot_in(self, block: int, best_effort: bool, position: int) -> int:
        """The flat device slot of `position` in `block`, for a page of this class."""
        offset = position % self.block_size
        return block * self.block_size + (self.block_size - 1 - offset if best_effort else offset)

    def device_slot(self, seq_id: SeqId, position: int) -> int:
        state = self.seqs[seq_id]
        block = state.pages[position // self.block_size]
        if block is None:
            raise ValueError(f"position {position} of {seq_id!r} is swapped out")
        return self.slot_in(block, state.best_effort, position)

    def fill_at(self, num_tokens: int, page: int) -> int:
        """How many positions page `page` holds in a sequence of `num_tokens`."""
        return max(0, min(self.block_size, num_tokens - page * self.block_size))

    def fill(self, seq_id: SeqId, page: int) -> int:
        return self.fill_at(self.seqs[seq_id].num_tokens, page)

    def rt_fill(self, block: int) -> int:
        owner = self.rt[block]
        return 0 if owner is None else self.fill(*owner)

    def resident(self, seq_id: SeqId, page: int) -> list[int]:
        """Positions of `page` whose KV is on the device."""
        if self.seqs[seq_id].pages[page] is None:
            return []
        lost = self.preemption_table.get((seq_id, page))
        start = page * self.block_size
        return [p for p in range(start, start + self.fill(seq_id, page)) if lost is None or p not in lost.host_slots]

    def live_be(self, block: int, gone: frozenset) -> PageKey | None:
        """The BE page on `block`, unless its sequence is among `gone`."""
        owner = self.be[block]
        return None if owner is None or owner[0] in gone else owner

    def be_positions_under(self, block: int, gone: frozenset, lo: int = 0, hi: int | None = None
                           ) -> list[tuple[PageKey, int]]:
        """The block's on-device BE positions in slots [lo, hi): what an RT fill there overwrites."""
        owner, hi = self.live_be(block, gone), self.block_size if hi is None else hi
        if not owner:
            return []
        return [(owner, p) for p in self.resident(*owner) if lo <= self.slot_in(0, True, p) < hi]

    def spare_host_slots(self, entry: PreemptedPage) -> list[int]:
        """Host slots of `entry`'s host blocks that hold none of its positions."""
        used = set(entry.host_slots.values())
        return [s for b in entry.host_blocks for s in self.host.slots(b) if s not in used]

    def host_blocks_needed(self, saves: list[tuple[PageKey, int]]) -> int:
        """Host blocks that checkpointing `saves` takes beyond their entries' spare slots."""
        need = 0
        for key, count in Counter(key for key, _ in saves).items():
            spare = len(self.spare_host_slots(self.preemption_table[key])) if key in self.preemption_table else 0
            need += max(0, -(-(count - spare) // self.block_size))
        return need

    # -- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the invariants of the module docstring (and the host store's)."""
        B, used = self.block_size, set()
        slot_owner: dict[int, tuple[SeqId, int]] = {}
        host_owned: defaultdict[SeqId, list[int]] = defaultdict(list)
        block: int | None  # a page's device block below; None: swapped out
        shared = {b for b, (rt, be) in enumerate(zip(self.rt, self.be)) if rt is not None and be is not None}
        for sides, best_effort in ((self.rt, False), (self.be, True)):
            for block, (seq_id, page) in ((b, o) for b, o in enumerate(sides) if o is not None):
                state = self.seqs.get(seq_id)
                assert state and state.best_effort == best_effort, f"block {block}: {seq_id!r} on the wrong side"
                assert state.pages[page] == block, f"block {block} names {seq_id!r} page {page}, which is elsewhere"
        for seq_id, state in self.seqs.items():
            assert len(state.pages) == -(-state.num_tokens // B), f"{seq_id!r}: table size != positions"
            for page, block in enumerate(state.pages):
                if block is None:
                    assert (seq_id, page) in self.preemption_table, f"{seq_id!r} page {page}: off device, no record"
                    continue
                assert self.sides(state.best_effort)[block] == (seq_id, page), f"{seq_id!r} page {page}"
                used.add(block)
                if block not in shared:
                    # One side taken: the block holds this page alone (each side has one owner,
                    # checked just above), so none of its slots can be anyone else's.
                    continue
                for position in self.resident(seq_id, page):
                    slot = self.slot_in(block, state.best_effort, position)
                    assert slot not in slot_owner, f"slot {slot}: {slot_owner.get(slot)} and {seq_id!r}"
                    slot_owner[slot] = (seq_id, position)
        for block in shared:  # only a block with both sides taken can have RT meet BE
            assert not self.be_positions_under(block, NOBODY, 0, self.rt_fill(block)), f"block {block}: RT meets BE"
        free = sum(rt is None and be is None for rt, be in zip(self.rt, self.be))
        assert free == self.num_free_blocks and free + len(used) == self.num_blocks, "blocks lost or invented"
        index = self.index
        assert all(k == self.key(b) or (b in self.stale and FREE not in (k, self.key(b)))
                   for b, k in enumerate(index.key)), "index key out of date"
        assert +index.sizes == +Counter(index.key), "index sizes out of date"
        blocks_by_key: dict = defaultdict(set)
        for b, k in enumerate(index.key):
            blocks_by_key[k].add(b)
        for key, heap in index.heaps.items():
            assert blocks_by_key.get(key, set()) <= set(heap), f"{key}: heap lost a block"
        for (seq_id, page), entry in self.preemption_table.items():
            state, slots = self.seqs[seq_id], list(entry.host_slots.values())
            positions = set(range(page * B, page * B + self.fill(seq_id, page)))
            assert entry.host_slots and set(entry.host_slots) <= positions, f"{seq_id!r} page {page}: bad entry"
            assert entry.block == state.pages[page], f"{seq_id!r} page {page}: entry names the wrong block"
            assert entry.block is not None or set(entry.host_slots) == positions, "swapped-out page not all on host"
            assert entry.block is None or state.best_effort, "only BE pages lose single slots"
            assert len(set(slots)) == len(slots), "two positions share a host slot"
            assert set(slots) <= {s for b in entry.host_blocks for s in self.host.slots(b)}, "host slot outside entry"
            assert len(entry.host_blocks) == -(-len(slots) // B), "host blocks not packed"
            host_owned[seq_id] += entry.host_blocks
            assert page in state.host_pages, f"{seq_id!r} page {page}: entry not in host_pages"
        for seq_id, state in self.seqs.items():
            assert sorted(self.host.blocks_of(seq_id)) == sorted(host_owned[seq_id]), f"{seq_id!r}: host blocks leak"
            assert all((seq_id, p) in self.preemption_table for p in state.host_pages), f"{seq_id!r}: host_pages"
        assert self.pinned <= set(self.seqs), "a pinned sequence is unknown"
        self.host.check_invariants()
        if not self.seqs:
            assert self.num_free_blocks == self.num_blocks and not self.preemption_table, "leak after free"
