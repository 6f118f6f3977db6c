"""Exact KV allocation from predicted response lengths (EcoServe: ecoserve.txt §2.3, §3.2, §3.4).

Admission reserves, at once, blocks for `prompt + ceil(RL * (1 + padding_ratio))` tokens (§2.3
padding, §3.2.1 exact allocation); growing inside them never allocates.

Under-prediction (§3.2.2): blocks past the reservation come from a reserved pool
(`reserved_fraction` of all blocks) that admission never touches. When it cannot cover a growth,
a request is preempted without offloading (`preempt`, by the caller, who picks the victim): its
blocks are freed, it recomputes, and it is re-admitted with `L_new = predicted - generated`.

KV pipelining (§3.4), as we read it. A resident request H with `w` written tokens lends the gap
between its write head and its first guest's region (or block `end` of its original allocation),
from the block holding the gap's midpoint, `start = ceil((w + end * B) / 2B)`, to `end`. A request
needing `need` (prompt + padded RL) slots is hosted there if it fits, `need <= (end - start) * B`,
and should finish `b` tokens before H's writes arrive, `need + b <= start * B - w`: the paper's
"RL below half the host's RL minus b", on the unused space so that a request part way through can
host (the prompt counts, conservatively, as steps). The tightest region wins ("closest to half").
Guests host in their own region (Fig. 9b's nesting dolls); the host's next guest lands in the
second half of its shrunken gap (r3 at L/4..L/2). Reserved-pool blocks are never lent. When H's
writes reach a region, its guest and everything nested in it are evicted: written KV is saved to
host blocks the guest owns or, with no host room, dropped (recompute); `ensure_resident` brings it
back into fresh blocks. A departing host's guests keep their KV in place: a top-level host's guest
takes ownership of its region (blocks are owned by whoever drew them from a pool), a nested one is
re-lent by the host's own host.

Invariants (`check_invariants`): 1. free + reserved pool + owned == total, each block once; the
reserved pool never exceeds its target (full, with no requests: nothing leaked). 2. A resident
table covers its written positions; an evicted request holds no device blocks and has its written
positions saved in host blocks it owns. 3. A guest's region is its host's table [start, start +
len), past the host's written blocks, inside its original allocation, overlapping no sibling.
4. No two live written positions share a slot.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Hashable

from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.host import HostKVStore, KVCopy


@dataclass(frozen=True)
class ExactAllocConfig:
    block_size: int = 16
    padding_ratio: float = 0.15      # §2.3: the sweet spots were 10-20%
    reserved_fraction: float = 0.03  # §4: 2-4% of the KV cache worked best
    pipeline_buffer: int = 0         # b of §3.4, in tokens
    min_new_prediction: int = 1      # floor for L_new: an overrun request still has work to do

    def __post_init__(self) -> None:
        if (self.block_size < 1 or self.padding_ratio < 0 or self.pipeline_buffer < 0
                or not 0 <= self.reserved_fraction < 1 or self.min_new_prediction < 1):
            raise ValueError("need block_size, min_new_prediction >= 1; padding_ratio, pipeline_buffer >= 0; reserved_fraction < 1")


@dataclass(eq=False, slots=True)  # one per running request, read every step: compact
class _Seq:
    predicted_len: int
    reservation: int                 # token slots promised at admission
    table: list[int]
    base: int                        # blocks of the original allocation: the only hostable part
    written: int = 0
    host: Hashable | None = None
    region_start: int = 0            # where table[0] sits in the host's table, in blocks
    children: list[Hashable] = field(default_factory=list)  # hosted requests, by region_start
    resident: bool = True
    order: int = 0                   # admission number: of two equally tight hosts, the earlier wins


class ExactAllocator:
    def __init__(self, num_blocks: int, config: ExactAllocConfig, host_store: HostKVStore | None = None):
        if num_blocks < 1 or (host_store is not None and host_store.block_size != config.block_size):
            raise ValueError("num_blocks must be positive and the host store use the same block size")
        self.num_blocks, self.config, self.block_size, self.host_store = num_blocks, config, config.block_size, host_store
        self.reserve_target = int(num_blocks * config.reserved_fraction)
        stack = list(range(num_blocks - 1, -1, -1))  # stacks: low ids are handed out first
        self._reserve, self._free = stack[:self.reserve_target], stack[self.reserve_target:]
        self._seqs: dict[Hashable, _Seq] = {}
        self._lenders: list[tuple[int, int, Hashable]] = []  # a heap of possible hosts: see `_lend`
        self.num_guests = 0  # requests in a host's region: while there are none, no order matters (`ExactKV.order`)
        # Counters, so tests and benchmarks can see which mechanism ran.
        self.admissions = self.hosted_placements = self.reserved_pool_draws = self.preemptions = 0
        self.hosted_evictions = self.hosted_drops = self.restores = 0

    # -- queries: none changes anything --------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_reserved_pool_blocks(self) -> int:
        return len(self._reserve)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reservation_tokens(self, prompt_len: int, predicted_len: int) -> int:
        # The epsilon keeps float noise (20 * 0.1 = 2.0000000000000004) from costing a token.
        return prompt_len + predicted_len + math.ceil(predicted_len * self.config.padding_ratio - 1e-9)

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def is_resident(self, seq_id: Hashable) -> bool:
        return self._seqs[seq_id].resident

    def num_written(self, seq_id: Hashable) -> int:
        return self._seqs[seq_id].written

    def host_of(self, seq_id: Hashable) -> Hashable | None:
        return self._seqs[seq_id].host

    def hosted_by(self, seq_id: Hashable) -> list[Hashable]:
        return list(self._seqs[seq_id].children)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The live table, not a copy (asked for every running request every step): callers must not modify it.
        Empty while the request is evicted; it only grows in place, and an eviction or a restore replaces it."""
        return self._seqs[seq_id].table

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Flat cache slots of written positions [start, end): past the write head may be a guest's."""
        seq = self._seqs[seq_id]
        if end > seq.written or not seq.resident:
            raise IndexError(f"{seq_id!r}: positions up to {end} are not written and resident")
        return self._slots(seq.table, start, end)

    def can_admit(self, prompt_len: int, predicted_len: int, *, allow_hosting: bool = True) -> bool:
        need = self.reservation_tokens(prompt_len, predicted_len)
        return (allow_hosting and self._best_host(need) is not None) or self.blocks_for(need) <= len(self._free)

    def can_grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Could `grow` (after `ensure_resident`, if evicted) succeed now, past the table from the reserved pool?"""
        seq = self._seqs[seq_id]
        blocks = len(seq.table) if seq.resident else self.blocks_for(max(seq.reservation, seq.written))  # restore
        fits = self.blocks_for(seq.written + num_tokens) - blocks <= len(self._reserve)
        return fits and (seq.resident or blocks <= len(self._free))

    def can_write(self, seq_id: Hashable, end: int) -> bool:
        """`can_grow` to `end` written positions; most calls (a decode inside the table) answer at once."""
        seq = self._seqs[seq_id]
        if seq.resident and end <= len(seq.table) * self.block_size:
            return True
        return self.can_grow(seq_id, max(0, end - seq.written))

    # -- mutations: each is all or nothing, raising NoFreeBlocksError and changing nothing -----
    def admit(self, seq_id: Hashable, prompt_len: int, predicted_len: int, *, allow_hosting: bool = True) -> Hashable | None:
        """Reserve the whole predicted footprint, in a host's region if one fits (§3.4) or from the
        admission pool; returns the host's id or None. `grow` writes the positions, prompt included."""
        if seq_id in self._seqs or prompt_len < 0 or predicted_len < 1:
            raise ValueError(f"{seq_id!r}: admitted twice, or prompt_len < 0 or predicted_len < 1")
        need = self.reservation_tokens(prompt_len, predicted_len)
        spot = self._best_host(need) if allow_hosting else None
        if spot is not None:
            host_id, start, end = spot
            host = self._seqs[host_id]
            seq = _Seq(predicted_len, need, host.table[start:end], end - start, host=host_id, region_start=start)
            host.children.insert(0, seq_id)  # its region ends where the first guest's begins
            self.hosted_placements += 1
            self.num_guests += 1
        else:
            blocks = self.blocks_for(need)
            if blocks > len(self._free):
                raise NoFreeBlocksError(f"need {blocks} blocks, {len(self._free)} free and no host fits")
            seq = _Seq(predicted_len, need, [self._free.pop() for _ in range(blocks)], blocks)
        seq.order, self._seqs[seq_id] = self.admissions, seq
        self.admissions += 1
        self._lend(seq_id, seq)
        return seq.host

    def write_within(self, seq_id: Hashable, end: int) -> bool:
        """`grow` to `end` written positions if that takes nothing (resident, inside its table, short
        of its first guest): most decodes, in one call. False: nothing changed, `grow` decides."""
        seq = self._seqs.get(seq_id)
        if seq is None or not seq.resident or end > len(seq.table) * self.block_size or (
                seq.children and self._seqs[seq.children[0]].region_start * self.block_size < end):
            return False
        seq.written = max(seq.written, end)
        return True

    def grow(self, seq_id: Hashable, num_tokens: int) -> list[KVCopy]:
        """Mark `num_tokens` more positions written, past the reservation from the reserved pool
        (§3.2.2); returns the saves of the guests its writes reach, to run before the forward pass.
        When the pool is short the caller preempts someone (`preempt`) and tries again."""
        seq, copies, size = self._seqs[seq_id], [], self.block_size
        new_written = seq.written + num_tokens
        extra = -(-new_written // size) - len(seq.table)  # `can_grow`, in O(1) for a resident request
        if not seq.resident or extra > len(self._reserve):
            raise NoFreeBlocksError(f"{seq_id!r}: evicted (call ensure_resident) or the reserved pool is short")
        if seq.children and self._seqs[seq.children[0]].region_start * size < new_written:  # in region order:
            reached = [c for c in seq.children if self._seqs[c].region_start * size < new_written]  # a prefix
            seq.children = seq.children[len(reached):]
            copies = [copy for child_id in reached for copy in self._evict(child_id)]
        if extra > 0:
            seq.table += [self._reserve.pop() for _ in range(extra)]
            self.reserved_pool_draws += extra
        seq.written = new_written
        return copies

    def preempt(self, seq_id: Hashable, generated: int) -> int:
        """Offload-free preemption (§3.2.2): free the request (its guests keep their KV) and return
        L_new, its prediction for re-admission with its `generated` tokens recomputed as prompt."""
        predicted = self._seqs[seq_id].predicted_len
        self._release(seq_id)
        self.preemptions += 1
        return max(self.config.min_new_prediction, predicted - generated)

    def ensure_resident(self, seq_id: Hashable) -> list[KVCopy]:
        """Bring an evicted request back into fresh admission-pool blocks; returns the loads (none
        if resident, or if its KV was dropped: then `num_written` is 0 and the caller recomputes)."""
        seq = self._seqs[seq_id]
        if seq.resident:
            return []
        blocks = self.blocks_for(max(seq.reservation, seq.written))  # the reservation, or all it wrote past it
        if blocks > len(self._free):
            raise NoFreeBlocksError(f"need {blocks} blocks, {len(self._free)} free")
        seq.table, seq.base, seq.resident = [self._free.pop() for _ in range(blocks)], blocks, True
        self.restores += 1
        self._lend(seq_id, seq)
        if seq.written == 0:
            return []
        saved = self._slots(self.host_store.blocks_of(seq_id), 0, seq.written)
        return [KVCopy("load", tuple(saved), tuple(self.slot_mapping(seq_id, 0, seq.written)), reader=seq_id)]

    def free(self, seq_id: Hashable) -> int:
        """Release a finished request (guests keep their KV); returns the device blocks freed, 0 if unknown."""
        return self._release(seq_id) if seq_id in self._seqs else 0

    # -- internals -----------------------------------------------------------------------
    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Position p lives at slot `table[p // B] * B + p % B`, as in `BlockPool` (and the host store)."""
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]

    def _owned(self, seq: _Seq) -> list[int]:
        """Lent blocks stay the lender's: a guest owns only its blocks past its region."""
        return seq.table if seq.host is None else seq.table[seq.base:]

    def _lend(self, seq_id: Hashable, seq: _Seq) -> None:
        """Index a resident request as a possible host (`_best_host`); rebuilt when mostly stale."""
        if len(self._lenders) > 2 * len(self._seqs) + 64:
            self._lenders = sorted((s.written - s.base * self.block_size, s.order, i) for i, s in self._seqs.items() if s.resident)
        heapq.heappush(self._lenders, (seq.written - seq.base * self.block_size, seq.order, seq_id))

    def _best_host(self, need: int) -> tuple[Hashable, int, int] | None:
        """The tightest (host, start, end) region, in host blocks, that fits the §3.4 rule (ties: the earliest admitted).
        A region is at most half of base * B - written, which only shrinks as its host writes: `_lenders` holds that
        (negated) as of some earlier call, so only its entries of 2 * need or more are looked at, and pushed back fresh."""
        size, best, hosts = self.block_size, None, {}
        while self._lenders and -self._lenders[0][0] >= 2 * need:
            hosts[heapq.heappop(self._lenders)[2]] = None  # a host's older entries too: it is looked at once
        for host_id in hosts:
            host = self._seqs.get(host_id)
            if host is None or not host.resident:
                continue
            self._lend(host_id, host)
            end = self._seqs[host.children[0]].region_start if host.children else host.base
            start = -(-(host.written + end * size) // (2 * size))
            fits = need <= (end - start) * size and need + self.config.pipeline_buffer <= start * size - host.written
            if fits and (best is None or (end - start, host.order) < best[0]):
                best = ((end - start, host.order), (host_id, start, end))
        return best and best[1]

    def _give_back(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # refill the reserved pool first: it guards running requests
            (self._reserve if len(self._reserve) < self.reserve_target else self._free).append(block)

    def _evict(self, seq_id: Hashable) -> list[KVCopy]:
        """Save (or drop) `seq_id` and everything nested in it; the lent blocks stay with the lender."""
        seq = self._seqs[seq_id]
        copies = [copy for child_id in seq.children for copy in self._evict(child_id)]
        self.hosted_evictions += 1
        host_blocks = self.blocks_for(seq.written)
        if self.host_store is None or host_blocks > self.host_store.num_free_blocks:
            seq.written, self.hosted_drops = 0, self.hosted_drops + 1  # no room: recompute later
        elif seq.written:
            saved = self._slots(self.host_store.allocate(seq_id, host_blocks), 0, seq.written)
            # Blocking: the host takes its region back in this very step (§3.4), so the step
            # waits for the guest's K/V to be out before its forward writes there.
            copies.append(KVCopy("save", tuple(self.slot_mapping(seq_id, 0, seq.written)), tuple(saved),
                                 blocking=True))
        self._give_back(self._owned(seq))
        self.num_guests -= seq.host is not None
        seq.table, seq.children, seq.host, seq.resident = [], [], None, False
        return copies

    def _release(self, seq_id: Hashable) -> int:
        seq = self._seqs.pop(seq_id)
        if self.host_store is not None:
            # A restored request's saved KV, kept until now: a save issued in the step that
            # restored it runs before the load and must never land on those host blocks.
            self.host_store.free(seq_id)
        if not seq.resident:
            return 0
        host = self._seqs[seq.host] if seq.host is not None else None
        # Its own place as a guest goes, and so do its guests' if it owned their regions (below).
        self.num_guests -= (host is not None) + (len(seq.children) if host is None else 0)
        adopted: set[int] = set()
        if host is not None:
            i = host.children.index(seq_id)
            host.children[i:i + 1] = seq.children  # they sit where our region was: still in order
        for child_id in seq.children:
            child = self._seqs[child_id]
            if host is not None:  # the region was lent to us: our host lends it on directly
                child.host, child.region_start = seq.host, seq.region_start + child.region_start
            else:  # the region was ours: the guest now owns it
                child.host = None
                adopted.update(child.table[:child.base])
        released = [b for b in self._owned(seq) if b not in adopted]
        self._give_back(released)
        return len(released)

    # -- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        owned = [b for s in self._seqs.values() if s.resident for b in self._owned(s)]
        assert sorted(owned + self._free + self._reserve) == list(range(self.num_blocks)), "blocks lost, invented, or owned twice"
        assert len(self._reserve) <= self.reserve_target, "the reserved pool overflowed"
        slots: list[int] = []
        keys = {seq_id: key for key, _, seq_id in sorted(self._lenders, key=lambda e: -e[0])}  # each id's least key
        for seq_id, seq in self._seqs.items():
            if not seq.resident:
                assert not seq.table and not seq.children and seq.host is None, f"{seq_id!r}: evicted but holds device state"
                saved = len(self.host_store.blocks_of(seq_id)) if self.host_store is not None else 0
                assert saved >= self.blocks_for(seq.written), f"{seq_id!r}: written KV neither saved nor dropped"
                continue
            assert len(seq.table) * self.block_size >= seq.written, f"{seq_id!r}: table does not cover the written positions"
            assert seq.base <= len(seq.table)
            assert keys.get(seq_id, math.inf) <= seq.written - seq.base * self.block_size, f"{seq_id!r}: missing from `_lenders`"
            slots += self.slot_mapping(seq_id, 0, seq.written)
            assert seq.host is None or seq_id in self._seqs[seq.host].children, f"{seq_id!r}: host does not know its guest"
            edge = self.blocks_for(seq.written)
            for child_id in seq.children:
                child = self._seqs[child_id]
                assert child.resident and child.host == seq_id, f"{child_id!r}: wrong host link"
                assert child.region_start >= edge, f"{child_id!r}: region overlaps the host's written part or a sibling"
                edge = child.region_start + child.base
                assert child.table[:child.base] == seq.table[child.region_start:edge], f"{child_id!r}: region is not the host's blocks"
                assert edge <= seq.base, f"{child_id!r}: region outside the host's original allocation"
        assert len(slots) == len(set(slots)), "two live positions share a KV slot"
        assert self.num_guests == sum(s.host is not None for s in self._seqs.values()), "num_guests is off"
        # With every block accounted for above, a full reserved pool means everything else is free.
        assert self._seqs or len(self._reserve) == self.reserve_target, "blocks leaked with no requests left"
