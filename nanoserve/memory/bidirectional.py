"""BROS's bidirectional KV block manager: placement, lazy checkpointing, restore and the last
resort (bros.txt §5.2 block management; FindBlock / FindPreemptBlock of Alg. 1, §4.2).

One class, `BidirectionalBlockManager`, which owns three helpers and is the only one to call them:

    pool        `BidirectionalBlocks` (bidirectional_blocks.py): the block layout, the preemption
                table, the block index, the slot arithmetic and the invariants
    placement   `Placement` (bidirectional_placement.py): FindBlock / FindPreemptBlock, read-only
    growth      `FastGrowth` (bidirectional_growth.py): growth in place or onto free blocks, the
                shortcuts most decode steps take instead of a plan

Placement: a BE page takes the block with the most empty slots whose BE side is unused and
whose RT fill leaves it room (FindBlock). An RT page takes a free block, else shares the BE-only
block with the fewest BE slots on the device (FindPreemptBlock).
Lazy checkpointing: RT wins. Before an RT page grows onto slots its BE neighbour holds, just
those slots are saved to host blocks owned by the BE sequence; `preemption_table[(seq, page)]`
records which positions are on the host and where. A BE page that must grow into RT slots moves.
RT never overwrites a `pinned` sequence (one this step's forward pass reads).
Restore (`ensure_resident`): lost positions are loaded in place once the RT page has left, else
the page moves to a block with room (surviving slots moved, lost ones loaded from the host).
Last resort: an RT sequence that still finds no room drops the caller's `victims`, BE before RT,
least urgent first: swapped out to the host, or forgotten (recompute) when the host is full.

Mutations return `KVCopy` ops. Execute each call's list with its own `HostKVStore.execute`, in
call order, before the next forward pass: one execute runs every save before any load, and a
later call may save a slot that an earlier call's move or load fills. `grow` (restore, then
allocate) is the one combined call whose copies are safe in a single execute; see its docstring.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from nanoserve.memory.bidirectional_blocks import BidirectionalBlocks
from nanoserve.memory.bidirectional_growth import FastGrowth
from nanoserve.memory.bidirectional_index import NOBODY, DropResult, HostLedger, PageKey, PreemptedPage, SeqId, SeqState
from nanoserve.memory.bidirectional_placement import Placement
from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.host import HostKVStore, KVCopy

_PROBE = ("no such sequence", "can_place_rt_page")  # a sequence id no caller uses


@dataclass
class _Plan:
    """An allocation or restore worked out before anything changes, so each is all or nothing."""

    placements: dict[int, int] = field(default_factory=dict)  # page -> its new block
    saves: list[tuple[PageKey, int]] = field(default_factory=list)  # BE positions an RT page overwrites
    copies: list[KVCopy] = field(default_factory=list)  # moves and loads
    restored: list[int] = field(default_factory=list)  # pages whose host copies are released


class BidirectionalBlockManager:
    """Shared RT/BE blocks: placement, lazy checkpointing, restore and the last resort (§5.2)."""

    def __init__(self, num_blocks: int, block_size: int, host: HostKVStore) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._attach(BidirectionalBlocks(num_blocks, block_size, host))
        # (generation, pins, fewest positions) of a fresh RT sequence that could not grow; see `_known_rt_miss`.
        self._rt_miss: tuple[int, frozenset, int] | None = None
        # False in a `what_if` twin: a trial's moves and loads are never executed, so not built.
        self._builds_copies = True
        # Event counters, so callers and tests can see which mechanism ran.
        self.preemptions = 0  # RT pages placed on a block with a live BE page
        self.overwrites = 0  # BE pages that lost slots to an RT page
        self.checkpointed_slots = 0  # BE slots saved just before an RT page overwrote them
        self.restored_pages = self.relocated_pages = self.swap_outs = self.recomputes = 0

    def _attach(self, pool: BidirectionalBlocks) -> None:
        """Own `pool`, with the helpers that read and grow it."""
        self.pool = pool
        self.placement = Placement(pool)
        self.growth = FastGrowth(pool)

    def what_if(self, host: HostKVStore | HostLedger) -> BidirectionalBlockManager:
        """A throwaway manager to try a mutation on, over `host` (a ledger, not the store): its
        pool is `BidirectionalBlocks.what_if`'s copy, its counters and memo copies of these. It
        plans and applies as this one would, but returns no moves or loads (nobody runs them)."""
        twin = copy.copy(self)
        twin._attach(self.pool.what_if(host))
        twin._builds_copies = False
        return twin

    # -- the pool's state and queries -----------------------------------------------------
    @property
    def host(self) -> HostKVStore:
        return self.pool.host

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def preemption_table(self) -> dict[PageKey, PreemptedPage]:
        return self.pool.preemption_table

    @property
    def pinned(self) -> set[SeqId]:
        """Sequences this step's forward pass reads: an RT page may not overwrite them. The caller
        (the KVManager adapter) fills it and clears it each step."""
        return self.pool.pinned

    @property
    def generation(self) -> int:
        """Bumped by every mutation, so an answer can be remembered until the state changes."""
        return self.pool.generation

    def has(self, seq_id: SeqId) -> bool:
        return self.pool.has(seq_id)

    def is_best_effort(self, seq_id: SeqId) -> bool:
        return self.pool.is_best_effort(seq_id)

    def num_tokens(self, seq_id: SeqId) -> int:
        return self.pool.num_tokens(seq_id)

    def block_table(self, seq_id: SeqId) -> list[int]:
        return self.pool.block_table(seq_id)

    def missing_positions(self, seq_id: SeqId) -> list[int]:
        """Positions whose KV is on the host, not the device: `ensure_resident` brings them back."""
        return self.pool.missing_positions(seq_id)

    def host_positions(self) -> dict[SeqId, int]:
        """How many positions (`missing_positions`) each sequence with any has on the host."""
        return self.pool.host_positions()

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Flat device slots of positions [start, end), in the sequence's direction."""
        return self.pool.slot_mapping(seq_id, start, end)

    def free(self, seq_id: SeqId) -> None:
        """Release every device and host block of `seq_id`. Freeing an unknown id is a no-op."""
        self.pool.free(seq_id)

    def check_invariants(self) -> None:
        self.pool.check_invariants()

    def rt_pages_lacking(self, seq_id: SeqId, num_tokens: int) -> int:
        """Pages an RT sequence growing to `num_tokens` still needs a block for (new pages, or
        swapped-out ones to restore)."""
        return self.placement.rt_pages_lacking(seq_id, num_tokens)

    def rt_page_room(self) -> int:
        """Blocks that could take an RT page: free ones and those holding a BE page alone."""
        return self.placement.rt_page_room()

    # -- questions (change nothing) --------------------------------------------------------
    def can_allocate(self, seq_id: SeqId, num_tokens: int, *, best_effort: bool) -> bool:
        """Whether `allocate` would succeed without dropping anyone."""
        try:
            return (self.growth.in_place(seq_id, num_tokens, best_effort) is not None
                    or self.growth.fresh_pages(seq_id, num_tokens, best_effort) is not None
                    or self._plan_growth(seq_id, num_tokens, best_effort, NOBODY) is not None)
        except ValueError:
            return False

    def can_grow(self, seq_id: SeqId, num_tokens: int, *, best_effort: bool) -> bool:
        """Whether `grow` would succeed; exact, and changes nothing."""
        if self.growth.in_place(seq_id, num_tokens, best_effort) is not None:
            return True  # most decode steps
        if not best_effort and (self.placement.no_block_for_rt_page(seq_id, num_tokens)
                                or self._known_rt_miss(seq_id, num_tokens)):
            return False
        pool = self.pool
        if not (pool.has(seq_id) and pool.seqs[seq_id].host_pages):
            fits = self.can_allocate(seq_id, num_tokens, best_effort=best_effort)
            if not (fits or best_effort):
                self._note_rt_miss(seq_id, num_tokens)
            return fits
        if best_effort and self.placement.be_restore_out_of_reach(seq_id):
            return False
        if self._swapped_out_whole_beyond_reach(seq_id, num_tokens, best_effort):
            return False
        # Growth after a restore depends on where the restore puts the pages and which host
        # blocks it frees: run both on a throwaway copy rather than predict them.
        trial = self.what_if(HostLedger(pool.host.num_free_blocks, self.block_size, pool.host.num_blocks))
        try:
            trial._grow(seq_id, num_tokens, best_effort)
        except (NoFreeBlocksError, ValueError):
            return False
        return True

    def can_place_rt_page(self) -> bool:
        """Whether any block could take a new RT page now (FindPreemptBlock finds one whose BE
        slots, if any, can be checkpointed). If not, no RT sequence can gain a page: every page
        needs at least the block and the saves a one-position page does."""
        return self.can_grow(_PROBE, 1, best_effort=False)

    def _known_rt_miss(self, seq_id: SeqId, num_tokens: int) -> bool:
        """Whether an RT sequence growing to `num_tokens` is known not to fit: a new one of at most
        that many positions did not, and nothing changed since. In overload BROS asks this of
        hundreds of waiting RT requests a step; between two mutations only the first costs a search.

        Exact, because a new RT sequence of n positions needs the first ceil(n / B) blocks of
        FindPreemptBlock's ranking, which does not depend on who asks, and saves the BE slots
        under [0, fill) of each: a larger one needs a superset. An RT sequence that is wholly
        swapped out (RT pages leave the device whole) needs no less to come back and grow to n:
        the same blocks, the same saves, and less host room, since its host blocks are freed
        only after the restore."""
        miss, pool = self._rt_miss, self.pool
        if miss is None or miss[0] != pool.generation or miss[1] != pool.pinned:
            return False
        state = pool.seqs.get(seq_id)
        if state is not None:
            if state.best_effort or any(block is not None for block in state.pages):
                return False
            num_tokens = max(num_tokens, state.num_tokens)
        return num_tokens >= miss[2]

    def _swapped_out_whole_beyond_reach(self, seq_id: SeqId, num_tokens: int, best_effort: bool) -> bool:
        """Whether a sequence with no page on the device cannot come back and grow to
        `num_tokens`, settled by asking the same of a new sequence (one plan, no what-if copy of
        the pool). In overload BROS asks `can_grow` of every swapped-out request it passes, each
        step; most say no, and this answers them at a fraction of the what-if's cost.

        Necessary, so exact when it says no: the restore places the pages in order, each by the
        same ranking a new sequence's pages would take, and the growth after it takes the next
        blocks of that ranking (BE: FindBlock page by page, rooms as a new sequence's fills; RT:
        FindPreemptBlock, saving the BE slots under each page's fill, `_known_rt_miss`). So it
        needs every block a new sequence of that many positions would, the same saves, and the
        host room for them while its own host blocks are still held."""
        state = self.pool.seqs[seq_id]
        if any(block is not None for block in state.pages):
            return False
        num_tokens = max(num_tokens, state.num_tokens)
        if self.can_allocate(_PROBE, num_tokens, best_effort=best_effort):
            return False
        if not best_effort:
            self._note_rt_miss(_PROBE, num_tokens)  # the next waiting RT request asks no search
        return True

    def _note_rt_miss(self, seq_id: SeqId, num_tokens: int) -> None:
        pool = self.pool
        if seq_id in pool.seqs:
            return
        miss = self._rt_miss
        if miss is not None and miss[0] == pool.generation and miss[1] == pool.pinned:
            num_tokens = min(num_tokens, miss[2])
        self._rt_miss = (pool.generation, frozenset(pool.pinned), num_tokens)

    # -- mutations -----------------------------------------------------------------------
    def try_grow(self, seq_id: SeqId, num_tokens: int, *, best_effort: bool) -> list[KVCopy] | None:
        """`grow` if it can, else None (nothing changes): growth in place answers in one look,
        where a scheduler's `can_grow` and then `grow` would each look."""
        state = self.growth.in_place(seq_id, num_tokens, best_effort)
        if state is not None:
            self.growth.grow_in_place(state, num_tokens)
            return []
        if not self.can_grow(seq_id, num_tokens, best_effort=best_effort):
            return None
        return self.grow(seq_id, num_tokens, best_effort=best_effort)

    def grow(self, seq_id: SeqId, num_tokens: int, *, best_effort: bool) -> list[KVCopy]:
        """Restore what `seq_id` has on the host, then grow it to `num_tokens`; all or nothing.

        The copies are safe in ONE execute (saves, moves, loads): a BE page is restored into a
        block with room for the fill it grows to, so the growth moves nothing; an RT restore
        loads into its own new left sides, and RT growth only saves other sequences' BE slots,
        which no copy here writes. Every save reads a value from before the call; every move or
        load writes a slot of this sequence that nothing else in the call reads. The restored
        pages' host blocks are freed only at the end, so no save reuses a host slot a load reads.
        """
        state = self.growth.in_place(seq_id, num_tokens, best_effort)
        if state is not None:  # most decode steps: nothing to restore, plan or copy
            self.growth.grow_in_place(state, num_tokens)
            return []
        state = self.pool.seqs.get(seq_id)
        if state is None or not state.host_pages:  # nothing to restore: `allocate` alone is all or nothing
            try:
                return self.allocate(seq_id, num_tokens, best_effort=best_effort)
            except ValueError as error:  # as `can_grow` would have said: it cannot grow
                raise NoFreeBlocksError(f"cannot grow {seq_id!r} to {num_tokens} positions") from error
        if not self.can_grow(seq_id, num_tokens, best_effort=best_effort):
            raise NoFreeBlocksError(f"no room to restore and grow {seq_id!r} to {num_tokens} positions")
        return self._grow(seq_id, num_tokens, best_effort)

    def _grow(self, seq_id: SeqId, num_tokens: int, best_effort: bool) -> list[KVCopy]:
        held: list[int] = []  # host blocks the restore's loads read, freed after the growth
        state = self.pool.seqs.get(seq_id)
        copies = self._restore(seq_id, num_tokens, held) if state is not None and state.host_pages else []
        copies += self.allocate(seq_id, num_tokens, best_effort=best_effort)
        if held:
            self.pool.host.free(seq_id, held)
        return copies

    def allocate(self, seq_id: SeqId, num_tokens: int, *, best_effort: bool,
                 victims: Iterable[SeqId] = ()) -> list[KVCopy]:
        """Grow `seq_id` to `num_tokens` positions; all or nothing, else NoFreeBlocksError.

        The sequence must be resident. An RT sequence that finds no room drops the fewest of
        `victims` (least urgent first; BE ones before RT ones) that make room. Each dropped victim
        is swapped out (`missing_positions` covers it) or, when the host is full, forgotten
        (`has` turns False) and must be recomputed.
        """
        state = self.growth.in_place(seq_id, num_tokens, best_effort)
        if state is not None:  # most decode steps: no new page, nobody on the block's other side
            self.growth.grow_in_place(state, num_tokens)
            return []
        count = self.growth.fresh_pages(seq_id, num_tokens, best_effort)
        if count is not None:  # a page boundary crossed, or a new sequence: free blocks, in order
            self.growth.grow_onto_free(seq_id, num_tokens, best_effort, count)
            return []
        plan = self._plan_growth(seq_id, num_tokens, best_effort, NOBODY)
        copies: list[KVCopy] = []
        chosen = self._victims_to_drop(seq_id, num_tokens, victims) if plan is None and not best_effort else None
        if chosen:
            gone_plan = self._plan_growth(seq_id, num_tokens, False, frozenset(chosen))
            assert gone_plan is not None  # chosen because, with them gone, the growth fits
            reserve = self.pool.host_blocks_needed(gone_plan.saves)  # the overwrite checkpoints come first
            for victim in chosen:
                copies += self._drop(victim, reserve).copies
            plan = self._plan_growth(seq_id, num_tokens, False, NOBODY)
            assert plan is not None, "dropping the victims freed less than planned"
        if plan is None:
            raise NoFreeBlocksError(f"no room to grow {seq_id!r} to {num_tokens} positions")
        state = self.pool.seqs.setdefault(seq_id, SeqState(best_effort))
        return copies + self._commit(seq_id, plan, max(num_tokens, state.num_tokens))

    def ensure_resident(self, seq_id: SeqId, num_tokens: int = 0) -> list[KVCopy]:
        """Copy every missing position of `seq_id` back to the device; all or nothing. A BE page
        goes to a block with room for its fill at `num_tokens`, so growing there moves nothing."""
        return self._restore(seq_id, num_tokens, None)

    def _restore(self, seq_id: SeqId, num_tokens: int, held: list[int] | None) -> list[KVCopy]:
        plan = self._plan_restore(seq_id, num_tokens)
        if plan is None:
            raise NoFreeBlocksError(f"no room to restore {seq_id!r}")
        self.restored_pages += len(plan.restored)
        return self._commit(seq_id, plan, self.pool.seqs[seq_id].num_tokens, held)

    def drop(self, seq_id: SeqId) -> DropResult:
        """Swap `seq_id` out: save all its device KV to the host, or forget it if the host is full."""
        return self._drop(seq_id, host_reserve=0)

    # -- planning (reads state, changes nothing) -----------------------------------------
    def _plan_growth(self, seq_id: SeqId, num_tokens: int, best_effort: bool, gone: frozenset) -> _Plan | None:
        """Growth as if the sequences in `gone` had been dropped; None if it does not fit."""
        pool = self.pool
        state = pool.seqs.get(seq_id)
        if state is not None and (state.best_effort != best_effort or state.host_pages):
            raise ValueError(f"{seq_id!r} cannot change class or grow with KV on the host")
        state = state or SeqState(best_effort)
        B, plan, have, old = self.block_size, _Plan(), len(state.pages), state.num_tokens
        fills = [(page, min(B, num_tokens - page * B)) for page in range(have, -(-num_tokens // B))]
        if old % B and num_tokens > old:
            last, new_fill = state.pages[-1], min(B, num_tokens - (have - 1) * B)
            assert last is not None  # no page on the host (checked above): every page is on the device
            if not best_effort:  # the last page grows in place, over any BE slots in its way
                plan.saves += pool.be_positions_under(last, gone, old % B, new_fill)
            elif new_fill > B - pool.rt_fill(last):  # RT holds slots it must grow into: move the page
                fills.insert(0, (have - 1, new_fill))
        if best_effort:
            targets = self.placement.be_targets([fill for _, fill in fills], set())
            for (page, _), target in zip(fills, targets or []):
                plan.placements[page] = target
                plan.copies += self._copies_to(seq_id, page, target) if page < have else []
            return None if targets is None else plan
        targets = self.placement.rt_targets(len(fills), set(), gone)
        if targets is None:
            return None
        for (page, fill), block in zip(fills, targets):
            plan.placements[page] = block
            plan.saves += pool.be_positions_under(block, gone, 0, fill)
        return plan if self._saves_fit(plan.saves) else None

    def _victims_to_drop(self, seq_id: SeqId, num_tokens: int, victims: Iterable[SeqId]) -> list[SeqId] | None:
        seqs = self.pool.seqs
        on_device = [v for v in dict.fromkeys(victims) if v != seq_id and v in seqs
                     and any(b is not None for b in seqs[v].pages)]
        order = sorted(on_device, key=lambda v: not seqs[v].best_effort)  # stable: BE, then RT

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

    def _plan_restore(self, seq_id: SeqId, num_tokens: int) -> _Plan | None:
        pool = self.pool
        state, plan = pool.seqs[seq_id], _Plan()
        target: int | None
        rt_blocks: Iterator[int] = iter(())
        if not state.best_effort:  # RT pages leave whole, so each takes the next of one ranking
            rt_blocks = iter(self.placement.rt_targets(len(state.host_pages), set(), NOBODY) or [])
        for page, block in enumerate(state.pages):
            entry = pool.preemption_table.get((seq_id, page))
            if entry is None:
                continue
            taken, fill = set(plan.placements.values()), pool.fill(seq_id, page)
            # A BE page must also have room for the fill it is about to grow to (see `grow`).
            room = pool.fill_at(max(num_tokens, state.num_tokens), page)
            # Only BE pages lose single slots (block is not None), and they sit in [B - fill, B).
            if block is not None and self.block_size - pool.rt_fill(block) >= room:
                target = block  # the RT page that took these slots has left: load them in place
            elif state.best_effort:
                be_targets = self.placement.be_targets([room], taken)
                target = be_targets[0] if be_targets else None
            else:
                target = next(rt_blocks, None)
                plan.saves += pool.be_positions_under(target, NOBODY, 0, fill) if target is not None else []
            if target is None:
                return None
            plan.copies += self._copies_to(seq_id, page, target)
            plan.restored.append(page)
            if target != block:
                plan.placements[page] = target
        return plan if self._saves_fit(plan.saves) else None

    def _saves_fit(self, saves: list[tuple[PageKey, int]]) -> bool:
        """The host has room for the checkpoints, and none overwrites a pinned sequence."""
        pool = self.pool
        return not saves or (pool.host_blocks_needed(saves) <= pool.host.num_free_blocks
                and not any(seq in pool.pinned for (seq, _), _ in saves))

    def _copies_to(self, seq_id: SeqId, page: int, target: int) -> list[KVCopy]:
        """Bring all of `page` into block `target`: move what is on the device, load the rest."""
        if not self._builds_copies:
            return []
        pool = self.pool
        state, entry = pool.seqs[seq_id], pool.preemption_table.get((seq_id, page))
        kept = pool.resident(seq_id, page) if state.pages[page] != target else []
        lost = sorted(entry.host_slots) if entry else []
        slot_in, best_effort = pool.slot_in, state.best_effort
        copies = [KVCopy("move", tuple(pool.device_slot(seq_id, p) for p in kept),
                         tuple(slot_in(target, best_effort, p) for p in kept), reader=seq_id)] if kept else []
        if not lost:
            return copies
        assert entry is not None  # lost is read from it
        return copies + [KVCopy("load", tuple(entry.host_slots[p] for p in lost),
                                tuple(slot_in(target, best_effort, p) for p in lost), reader=seq_id)]

    # -- applying ------------------------------------------------------------------------
    def _commit(self, seq_id: SeqId, plan: _Plan, num_tokens: int, held: list[int] | None = None) -> list[KVCopy]:
        """Apply `plan`. The host blocks of restored pages are freed, or added to `held`."""
        pool = self.pool
        pool.changed()
        state = pool.seqs[seq_id]
        sides = pool.sides(state.best_effort)
        # Blocks to refile: each side that changes owner or fill, or whose BE page loses slots.
        touched = {state.pages[p] for p in plan.placements if p < len(state.pages)} | set(plan.placements.values())
        self.overwrites += len({key for key, _ in plan.saves})
        self.checkpointed_slots += len(plan.saves)
        copies = self._checkpoint(plan.saves) + plan.copies  # host blocks are taken before any is freed
        for page, block in sorted(plan.placements.items()):
            if page == len(state.pages):
                state.pages.append(None)
            if (old := state.pages[page]) is not None:
                sides[old] = None
                self.relocated_pages += 1
            state.pages[page] = block
            sides[block] = (seq_id, page)
            self.preemptions += not state.best_effort and pool.be[block] is not None
        for page in plan.restored:
            blocks = pool.preemption_table.pop((seq_id, page)).host_blocks
            state.host_pages.discard(page)
            touched.add(state.pages[page])
            if held is None:
                pool.host.free(seq_id, blocks)
            else:
                held.extend(blocks)
        touched.update(state.pages[max(0, state.num_tokens - 1) // self.block_size:])  # fills that grow
        state.num_tokens = num_tokens
        pool.reindex(*touched)
        return copies

    def _checkpoint(self, saves: list[tuple[PageKey, int]]) -> list[KVCopy]:
        """Save device positions into host slots of their page's entry, taking host blocks as needed."""
        if not saves:
            return []
        pool = self.pool
        by_page: dict[PageKey, list[int]] = defaultdict(list)
        for key, position in saves:
            by_page[key].append(position)
        copies = []
        for (seq_id, page), positions in by_page.items():
            entry = pool.preemption_table.setdefault((seq_id, page), PreemptedPage(pool.seqs[seq_id].pages[page]))
            pool.seqs[seq_id].host_pages.add(page)
            spare = pool.spare_host_slots(entry)
            if len(positions) > len(spare):
                new = pool.host.allocate(seq_id, -(-(len(positions) - len(spare)) // self.block_size))
                entry.host_blocks += new
                spare += [s for b in new for s in pool.host.slots(b)]
            entry.host_slots.update(zip(positions, spare))
            # Blocking: an RT page overwrites these slots in this very step (§5.2), or the
            # swapped-out sequence's blocks are handed on at once; the step waits for the save.
            copies.append(KVCopy("save", tuple(pool.device_slot(seq_id, p) for p in positions),
                                 tuple(entry.host_slots[p] for p in positions), blocking=True))
        return copies

    def _drop(self, seq_id: SeqId, host_reserve: int) -> DropResult:
        pool = self.pool
        pool.changed()
        state = pool.seqs[seq_id]
        saves = [((seq_id, page), p) for page in range(len(state.pages)) for p in pool.resident(seq_id, page)]
        if pool.host_blocks_needed(saves) > pool.host.num_free_blocks - host_reserve:
            pool.free(seq_id)
            self.recomputes += 1
            return DropResult((), recompute=True)
        copies = self._checkpoint(saves)
        sides = pool.sides(state.best_effort)
        for page, block in enumerate(state.pages):
            if block is not None:
                sides[block] = None
                pool.reindex(block)
            state.pages[page] = pool.preemption_table[(seq_id, page)].block = None
        self.swap_outs += 1
        return DropResult(tuple(copies), recompute=False)
