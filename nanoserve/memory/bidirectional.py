"""BROS's bidirectional KV block manager (bros.txt §5.1 block structure, §5.2 block management,
and FindBlock / FindPreemptBlock of Alg. 1, §4.2).

A block of B slots serves at most one real-time (RT) page, filling slots 0, 1, ... left to right,
and one best-effort (BE) page, filling slots B-1, B-2, ... right to left. Position p of a
sequence lives in block `table[p // B]` at slot `p % B` (RT) or `B - 1 - p % B` (BE), the layout
the attention kernels read with `directions[s] = is_best_effort(s)`; positions [i*B, i*B + B)
form page i, and a page sits in one block.

Placement: a BE page takes the block with the most empty slots whose BE side is unused and
whose RT fill leaves it room (FindBlock). An RT page takes a free block, else shares the BE-only
block with the fewest BE slots on the device (FindPreemptBlock).
Lazy checkpointing: RT wins. Before an RT page grows onto slots its BE neighbour holds, just
those slots are saved to host blocks owned by the BE sequence; `preemption_table[(seq, page)]`
records which positions are on the host and where. A BE page that must grow into RT slots moves.
Restore (`ensure_resident`): lost positions are loaded in place once the RT page has left, else
the page moves to a block with room (surviving slots moved, lost ones loaded from the host).
Last resort: an RT sequence that still finds no room drops the caller's `victims`, BE before RT,
least urgent first: swapped out to the host, or forgotten (recompute) when the host is full.

Mutations return `KVCopy` ops. Execute each call's list with its own `HostKVStore.execute`, in
call order, before the next forward pass: one execute runs every save before any load, and a
later call may save a slot that an earlier call's move or load fills.

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
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Hashable, Iterable

from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.host import HostKVStore, KVCopy

SeqId = Hashable
PageKey = tuple[SeqId, int]  # (sequence, page index)
NOBODY: frozenset = frozenset()


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
class _Seq:
    best_effort: bool
    num_tokens: int = 0
    pages: list[int | None] = field(default_factory=list)  # block per page; None when swapped out


@dataclass
class _Plan:
    """An allocation or restore worked out before anything changes, so each is all or nothing."""

    placements: dict[int, int] = field(default_factory=dict)  # page -> its new block
    saves: list[tuple[PageKey, int]] = field(default_factory=list)  # BE positions an RT page overwrites
    copies: list[KVCopy] = field(default_factory=list)  # moves and loads
    restored: list[int] = field(default_factory=list)  # pages whose host copies are released


class BidirectionalBlockManager:
    def __init__(self, num_blocks: int, block_size: int, host: HostKVStore):
        if num_blocks < 1 or block_size < 1 or host.block_size != block_size:
            raise ValueError("need positive sizes and a host store with the same block size")
        self.num_blocks, self.block_size, self.host = num_blocks, block_size, host
        self._rt: list[PageKey | None] = [None] * num_blocks  # the page on each block's left side
        self._be: list[PageKey | None] = [None] * num_blocks  # the page on each block's right side
        self._seqs: dict[SeqId, _Seq] = {}
        self.preemption_table: dict[PageKey, PreemptedPage] = {}
        # Event counters, so callers and tests can see which mechanism ran.
        self.preemptions = 0  # RT pages placed on a block with a live BE page
        self.overwrites = 0  # BE pages that lost slots to an RT page
        self.checkpointed_slots = 0  # BE slots saved just before an RT page overwrote them
        self.restored_pages = self.relocated_pages = self.swap_outs = self.recomputes = 0

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return sum(rt is None and be is None for rt, be in zip(self._rt, self._be))

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
        return sorted(p for (seq, _), entry in self.preemption_table.items() if seq == seq_id for p in entry.host_slots)

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Flat device slots of positions [start, end), in the sequence's direction."""
        if end > self._seqs[seq_id].num_tokens:
            raise IndexError(f"positions up to {end} exceed the {self._seqs[seq_id].num_tokens} allocated")
        return [self._device_slot(seq_id, p) for p in range(start, end)]

    def can_allocate(self, seq_id: SeqId, num_tokens: int, *, best_effort: bool) -> bool:
        """Whether `allocate` would succeed without dropping anyone."""
        try:
            return self._plan_growth(seq_id, num_tokens, best_effort, NOBODY) is not None
        except ValueError:
            return False

    # -- mutations -----------------------------------------------------------------------
    def allocate(self, seq_id: SeqId, num_tokens: int, *, best_effort: bool,
                 victims: Iterable[SeqId] = ()) -> list[KVCopy]:
        """Grow `seq_id` to `num_tokens` positions; all or nothing, else NoFreeBlocksError.

        The sequence must be resident. An RT sequence that finds no room drops the fewest of
        `victims` (least urgent first; BE ones before RT ones) that make room. Each dropped victim
        is swapped out (`missing_positions` covers it) or, when the host is full, forgotten
        (`has` turns False) and must be recomputed.
        """
        plan, copies = self._plan_growth(seq_id, num_tokens, best_effort, NOBODY), []
        chosen = self._victims_to_drop(seq_id, num_tokens, victims) if plan is None and not best_effort else None
        if chosen:
            gone_plan = self._plan_growth(seq_id, num_tokens, False, frozenset(chosen))
            reserve = self._host_blocks_needed(gone_plan.saves)  # the overwrite checkpoints come first
            for victim in chosen:
                copies += self._drop(victim, reserve).copies
            plan = self._plan_growth(seq_id, num_tokens, False, NOBODY)
            assert plan is not None, "dropping the victims freed less than planned"
        if plan is None:
            raise NoFreeBlocksError(f"no room to grow {seq_id!r} to {num_tokens} positions")
        state = self._seqs.setdefault(seq_id, _Seq(best_effort))
        return copies + self._commit(seq_id, plan, max(num_tokens, state.num_tokens))

    def ensure_resident(self, seq_id: SeqId) -> list[KVCopy]:
        """Copy every missing position of `seq_id` back to the device; all or nothing."""
        plan = self._plan_restore(seq_id)
        if plan is None:
            raise NoFreeBlocksError(f"no room to restore {seq_id!r}")
        self.restored_pages += len(plan.restored)
        return self._commit(seq_id, plan, self._seqs[seq_id].num_tokens)

    def drop(self, seq_id: SeqId) -> DropResult:
        """Swap `seq_id` out: save all its device KV to the host, or forget it if the host is full."""
        return self._drop(seq_id, host_reserve=0)

    def free(self, seq_id: SeqId) -> None:
        """Release every device and host block of `seq_id`. Freeing an unknown id is a no-op."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return
        sides = self._be if state.best_effort else self._rt
        for page, block in enumerate(state.pages):
            if block is not None:
                sides[block] = None
            entry = self.preemption_table.pop((seq_id, page), None)
            if entry is not None:
                self.host.free(seq_id, entry.host_blocks)

    # -- planning (reads state, changes nothing) -----------------------------------------
    def _plan_growth(self, seq_id: SeqId, num_tokens: int, best_effort: bool, gone: frozenset) -> _Plan | None:
        """Growth as if the sequences in `gone` had been dropped; None if it does not fit."""
        state = self._seqs.get(seq_id)
        if state is not None and (state.best_effort != best_effort or self.missing_positions(seq_id)):
            raise ValueError(f"{seq_id!r} cannot change class or grow with KV on the host")
        state = state or _Seq(best_effort)
        B, plan, have, old = self.block_size, _Plan(), len(state.pages), state.num_tokens
        fills = [(page, min(B, num_tokens - page * B)) for page in range(have, -(-num_tokens // B))]
        if old % B and num_tokens > old:
            last, new_fill = state.pages[-1], min(B, num_tokens - (have - 1) * B)
            if not best_effort:  # the last page grows in place, over any BE slots in its way
                plan.saves += self._be_positions_under(last, gone, old % B, new_fill)
            elif new_fill > B - self._rt_fill(last):  # RT holds slots it must grow into: move the page
                fills.insert(0, (have - 1, new_fill))
        if best_effort:
            for page, fill in fills:
                target = self._be_target(fill, set(plan.placements.values()))
                if target is None:
                    return None
                plan.placements[page] = target
                plan.copies += self._copies_to(seq_id, page, target) if page < have else []
            return plan
        targets = self._rt_targets(len(fills), set(), gone)
        if targets is None:
            return None
        for (page, fill), block in zip(fills, targets):
            plan.placements[page] = block
            plan.saves += self._be_positions_under(block, gone, 0, fill)
        return plan if self._host_blocks_needed(plan.saves) <= self.host.num_free_blocks else None

    def _victims_to_drop(self, seq_id: SeqId, num_tokens: int, victims: Iterable[SeqId]) -> list[SeqId] | None:
        on_device = [v for v in dict.fromkeys(victims) if v != seq_id and v in self._seqs
                     and any(b is not None for b in self._seqs[v].pages)]
        order = sorted(on_device, key=lambda v: not self._seqs[v].best_effort)  # stable: BE, then RT

        def fits(gone: list[SeqId]) -> bool:
            return self._plan_growth(seq_id, num_tokens, False, frozenset(gone)) is not None

        count = next((k for k in range(1, len(order) + 1) if fits(order[:k])), None)
        if count is None:
            return None
        chosen = order[:count]
        for victim in reversed(chosen[:-1]):  # spare the more urgent victims that need not go
            if fits([v for v in chosen if v != victim]):
                chosen.remove(victim)
        return chosen

    def _plan_restore(self, seq_id: SeqId) -> _Plan | None:
        state, plan = self._seqs[seq_id], _Plan()
        for page, block in enumerate(state.pages):
            entry = self.preemption_table.get((seq_id, page))
            if entry is None:
                continue
            taken, fill = set(plan.placements.values()), self._fill(seq_id, page)
            # Only BE pages lose single slots (block is not None): their slot of p is B - 1 - p % B.
            if block is not None and min(self._slot_in(0, True, p) for p in entry.host_slots) >= self._rt_fill(block):
                target = block  # the RT page that took these slots has left: load them in place
            elif state.best_effort:
                target = self._be_target(fill, taken)
            else:
                target = next(iter(self._rt_targets(1, taken, NOBODY) or []), None)
                plan.saves += self._be_positions_under(target, NOBODY, 0, fill) if target is not None else []
            if target is None:
                return None
            plan.copies += self._copies_to(seq_id, page, target)
            plan.restored.append(page)
            if target != block:
                plan.placements[page] = target
        return plan if self._host_blocks_needed(plan.saves) <= self.host.num_free_blocks else None

    def _rt_targets(self, count: int, taken: set[int], gone: frozenset) -> list[int] | None:
        """FindPreemptBlock: free blocks first, then BE blocks with the fewest BE slots on the device."""
        open_ = [b for b in range(self.num_blocks)
                 if b not in taken and (self._rt[b] is None or self._rt[b][0] in gone)]
        open_.sort(key=lambda b: (self._live_be(b, gone) is not None, len(self._be_positions_under(b, gone)), b))
        return open_[:count] if len(open_) >= count else None

    def _be_target(self, room: int, taken: set[int]) -> int | None:
        """FindBlock: the block with the most empty slots whose BE side is unused and fits `room`."""
        fits = [b for b in range(self.num_blocks)
                if b not in taken and self._be[b] is None and self.block_size - self._rt_fill(b) >= room]
        return min(fits, key=lambda b: (self._rt_fill(b), b), default=None)

    def _copies_to(self, seq_id: SeqId, page: int, target: int) -> list[KVCopy]:
        """Bring all of `page` into block `target`: move what is on the device, load the rest."""
        state, entry = self._seqs[seq_id], self.preemption_table.get((seq_id, page))
        kept = self._resident(seq_id, page) if state.pages[page] != target else []
        lost = sorted(entry.host_slots) if entry else []
        copies = [KVCopy("move", tuple(self._device_slot(seq_id, p) for p in kept),
                         tuple(self._slot_in(target, state.best_effort, p) for p in kept))] if kept else []
        return copies + ([KVCopy("load", tuple(entry.host_slots[p] for p in lost),
                                 tuple(self._slot_in(target, state.best_effort, p) for p in lost))] if lost else [])

    # -- applying ------------------------------------------------------------------------
    def _commit(self, seq_id: SeqId, plan: _Plan, num_tokens: int) -> list[KVCopy]:
        state = self._seqs[seq_id]
        sides = self._be if state.best_effort else self._rt
        self.overwrites += len({key for key, _ in plan.saves})
        self.checkpointed_slots += len(plan.saves)
        copies = self._checkpoint(plan.saves) + plan.copies  # host blocks are taken before any is freed
        for page, block in sorted(plan.placements.items()):
            if page == len(state.pages):
                state.pages.append(None)
            if state.pages[page] is not None:
                sides[state.pages[page]] = None
                self.relocated_pages += 1
            state.pages[page] = block
            sides[block] = (seq_id, page)
            self.preemptions += not state.best_effort and self._be[block] is not None
        for page in plan.restored:
            self.host.free(seq_id, self.preemption_table.pop((seq_id, page)).host_blocks)
        state.num_tokens = num_tokens
        return copies

    def _checkpoint(self, saves: list[tuple[PageKey, int]]) -> list[KVCopy]:
        """Save device positions into host slots of their page's entry, taking host blocks as needed."""
        by_page: dict[PageKey, list[int]] = defaultdict(list)
        for key, position in saves:
            by_page[key].append(position)
        copies = []
        for (seq_id, page), positions in by_page.items():
            entry = self.preemption_table.setdefault((seq_id, page), PreemptedPage(self._seqs[seq_id].pages[page]))
            spare = self._spare_host_slots(entry)
            if len(positions) > len(spare):
                new = self.host.allocate(seq_id, -(-(len(positions) - len(spare)) // self.block_size))
                entry.host_blocks += new
                spare += [s for b in new for s in self.host.slots(b)]
            entry.host_slots.update(zip(positions, spare))
            copies.append(KVCopy("save", tuple(self._device_slot(seq_id, p) for p in positions),
                                 tuple(entry.host_slots[p] for p in positions)))
        return copies

    def _drop(self, seq_id: SeqId, host_reserve: int) -> DropResult:
        state = self._seqs[seq_id]
        saves = [((seq_id, page), p) for page in range(len(state.pages)) for p in self._resident(seq_id, page)]
        if self._host_blocks_needed(saves) > self.host.num_free_blocks - host_reserve:
            self.free(seq_id)
            self.recomputes += 1
            return DropResult((), recompute=True)
        copies = self._checkpoint(saves)
        sides = self._be if state.best_effort else self._rt
        for page, block in enumerate(state.pages):
            if block is not None:
                sides[block] = None
            state.pages[page] = self.preemption_table[(seq_id, page)].block = None
        self.swap_outs += 1
        return DropResult(tuple(copies), recompute=False)

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

    def _fill(self, seq_id: SeqId, page: int) -> int:
        return max(0, min(self.block_size, self._seqs[seq_id].num_tokens - page * self.block_size))

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
        assert self.num_free_blocks + len(used) == self.num_blocks, "blocks were lost or invented"
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
        for seq_id in self._seqs:
            assert sorted(self.host.blocks_of(seq_id)) == sorted(host_owned[seq_id]), f"{seq_id!r}: host blocks leak"
        self.host.check_invariants()
        if not self._seqs:
            assert self.num_free_blocks == self.num_blocks and not self.preemption_table, "leak after free"
