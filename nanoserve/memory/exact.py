"""Exact KV allocation from predicted response lengths (EcoServe: ecoserve.txt §2.3, §3.2, §3.4).

SyncDecoupled (§3.2.1): "The KVC size allocated to a PT equals its prompt length, and that
allocated to a GT equals to its predicted RL." A request's life here, in allocator calls:

    admit_prompt ──► grow (prefill) ──► [queued: a GT in Q_G, prompt KV held] ──► batch ──► grow ...
                                                       ▲                            │
                                                       └────────── pause ◄──────────┘
                                                          (§3.2.2: can't grow, keeps its KV)

`admit` is the coupled form (prompt + padded RL at once): ORCA's max-allocation, any policy that
does not batch GTs itself, and a PT that spills past the reserved pool (exact_kv.py says when).

The pool, in blocks (one free list; the reserved pool is a budget over it, not separate blocks):

    ┌───────────── owned by requests ─────────────┬────────────── free ──────────────┐
    │ batched GTs: prompt + padded RL, overruns   │  A_KVC (GT batching, restores)   │
    │ PTs and queued GTs: prompt KV (charged, or  │  reserve_left                    │
    │   from A_KVC if the pool could not hold it) │                                  │
    └─────────────────────────────────────────────┴──────────────────────────────────┘
    reserve_target = charged (PT prompts + GT overruns) + reserve_left

- The reserved pool (§2.2: "A small amount of KVC space is reserved for adding PTs at each
  iteration"; §3.2.2: "when a request encounters an underprovisioning, it first tries to use the
  reserved KVC"): `reserve_target` blocks that GT batching and coupled admission never take. A
  PT's prompt blocks and a GT's blocks past its padded RL are charged to it. When a GT is batched
  its charge moves out (its whole footprint is now the GT's, drawn from A_KVC). A prompt the pool
  cannot hold takes its blocks from A_KVC, uncharged, when the caller allows it
  (`admit_prompt(from_available=True)`: §3.2.1's "prompts are selected ... until the available
  KVC space is fully allocated"); without that, prompt-stage KV never exceeds the pool and waiting
  GTs can always be batched once the KV drains (the paper does not bound the KV that waiting
  GTs' prompts hold; exact_kv.py's `long_prompts` chooses).
- Under-prediction (§3.2.2): growth past the allocation is charged to the reserved pool; when it
  is short the caller pauses the request (`pause`: it keeps its KV, as "a waiting GT occupies a
  certain KVC space ... for its previously generated tokens if it is preempted", §2.4) and
  batches it again later with L_new; or drops it (`preempt`, recompute).

KV pipelining (§3.4): "A request whose RL is less than but closest to half of r_1's RL is
identified as r_2", with a buffer: "EcoServe finds a hosted GT that has RL less than but closest
to half of the hosing GT's RL subtracting b tokens", b a fraction of the predicted RL (§4: 15%
ShareGPT and Alpaca, 10% BookCorpus). As we apply it to a host H with `w` written tokens, part
way through its allocation: H lends the gap between its write head and its first guest's region
(or block `end` of its allocation) from the block holding the gap's midpoint, `start = ceil((w +
end * B) / 2B)`, to `end`. A GT batched there must fit, `need <= end - start` blocks (its RL part:
its prompt's KV is already in its own blocks, "the tightest region" wins), and finish as predicted
b tokens before H's writes arrive: `RL + b <= start * B - w`. At H's start (w = its prompt, end =
its allocation) that is the paper's "RL < H's RL / 2 - b". assumption: b is the given fraction of
the *host's* predicted RL (the sentence subtracts it from the host's half), rounded up. A coupled
admission hosts its whole prompt + padded RL and counts the prompt as steps (conservative).
Guests host in their own region (Fig. 9b's nesting dolls). When H's writes reach a region, its
guest and everything nested in it are evicted: written KV is saved to host blocks the guest owns
or, with no host room, dropped (recompute); a later call brings it back into fresh blocks. A
departing host's guests keep their KV in place: a top-level host's guest takes ownership of its
region, a nested one is re-lent by the host's own host.

A guest's table: its own blocks [0, lent_from), the host's region [lent_from, base), its own
growth [base, ...): blocks are owned by whoever drew them from the free list.

Invariants (`check_invariants`): 1. free + owned == total, each block once. 2. charged ==
Σ per-request charges <= reserve_target <= free + charged (reserve_left is really free); a batched
request's charge is its blocks past its allocation; an evicted one holds none. 3. A resident table
covers its written positions; an unbatched one writes only within its reservation; `queued` is
exactly the unbatched ones done writing it. 4. A guest's region is its host's table [start, start
+ len), past the host's written blocks (and, for a nested host, inside the host's own region),
inside its allocation, overlapping no sibling; only batched requests host. 5. No two live written
positions share a slot.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from nanoserve.config import EngineArgs
from nanoserve.memory.blocks import NoFreeBlocksError
from nanoserve.memory.host import HostKVStore, KVCopy


@dataclass(frozen=True)
class ExactAllocConfig:
    block_size: int = EngineArgs.block_size
    padding_ratio: float = 0.15          # §2.3: the sweet spots were 10-20%
    reserved_fraction: float = 0.03      # §2.2: 1.2% Alpaca, 3% ShareGPT, 5% BookCorpus
    pipeline_buffer_ratio: float = 0.15  # b of §3.4, as a fraction of the host's predicted RL (§4)
    min_new_prediction: int = 1          # floor for L_new: an overrun request still has work to do

    def __post_init__(self) -> None:
        if (self.block_size < 1 or self.padding_ratio < 0 or self.pipeline_buffer_ratio < 0
                or not 0 <= self.reserved_fraction < 1 or self.min_new_prediction < 1):
            raise ValueError("need block_size, min_new_prediction >= 1; padding_ratio, pipeline_buffer_ratio >= 0; "
                             "reserved_fraction < 1")


@dataclass(eq=False, slots=True)  # one per request with KV, read every step: compact
class _Seq:
    predicted_len: int               # the RL its allocation is for (a PT's: none yet, 0)
    reservation: int                 # token slots it may write without another call
    table: list[int]
    base: int                        # its allocation ends at table[base]: the only hostable part
    base_tokens: int = 0             # tokens its allocation was made for (prompt, or more after a pause)
    written: int = 0
    batched: bool = True             # False: a PT, or a GT waiting in Q_G (prompt or paused KV only)
    charged: int = 0                 # of its blocks, those counted against the reserved pool
    lent_from: int = 0               # a guest's region is table[lent_from:base]
    host: Hashable | None = None
    region_start: int = 0            # where table[lent_from] sits in the host's table, in blocks
    children: list[Hashable] = field(default_factory=list)  # hosted requests, by region_start
    resident: bool = True
    order: int = 0                   # admission number: of two equally tight hosts, the earlier wins


class ExactAllocator:
    def __init__(self, num_blocks: int, config: ExactAllocConfig, host_store: HostKVStore | None = None):
        if num_blocks < 1 or (host_store is not None and host_store.block_size != config.block_size):
            raise ValueError("num_blocks must be positive and the host store use the same block size")
        self.num_blocks, self.config, self.block_size = num_blocks, config, config.block_size
        self.host_store = host_store
        self.reserve_target = int(num_blocks * config.reserved_fraction)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids are handed out first
        self._charged = 0  # blocks charged to the reserved pool, over all requests
        self._seqs: dict[Hashable, _Seq] = {}
        self._queued: set[Hashable] = set()  # unbatched and done writing their reservation: GTs in Q_G
        self._lenders: list[tuple[int, int, Hashable]] = []  # a heap of possible hosts: see `_lend`
        self.num_guests = 0  # requests in a host's region: while there are none, no order matters (`ExactKV.order`)
        # Counters, so tests and benchmarks can see which mechanism ran.
        self.admissions = self.prompt_admissions = self.prompt_admissions_available = 0
        self.batches = self.hosted_placements = 0
        self.reserved_pool_draws = self.pauses = self.preemptions = 0
        self.hosted_evictions = self.hosted_drops = self.restores = 0

    # -- queries: none changes anything --------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def reserve_left(self) -> int:
        """Free blocks the reserved pool still holds for PTs and overruns."""
        return self.reserve_target - self._charged

    @property
    def num_admission_blocks(self) -> int:
        """A_KVC: free blocks GT batching, coupled admission and restores may take."""
        return len(self._free) - self.reserve_left

    @property
    def num_queued(self) -> int:
        """GTs waiting to be batched (a finished prompt, or paused) that hold KV."""
        return len(self._queued)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reservation_tokens(self, prompt_len: int, predicted_len: int) -> int:
        # The epsilon keeps float noise (20 * 0.1 = 2.0000000000000004) from costing a token.
        return prompt_len + predicted_len + math.ceil(predicted_len * self.config.padding_ratio - 1e-9)

    def pipeline_buffer(self, host_predicted_len: int) -> int:
        """b of §3.4, in tokens, for a host with this predicted RL (see the module docstring)."""
        return math.ceil(host_predicted_len * self.config.pipeline_buffer_ratio - 1e-9)

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def is_resident(self, seq_id: Hashable) -> bool:
        return self._seqs[seq_id].resident

    def is_batched(self, seq_id: Hashable) -> bool:
        return self._seqs[seq_id].batched

    def reservation(self, seq_id: Hashable) -> int:
        return self._seqs[seq_id].reservation

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
        blocks = self.blocks_for(need)
        return blocks <= self.num_admission_blocks or (allow_hosting and self._best_host(blocks, need) is not None)

    def can_admit_prompt(self, prompt_len: int, *, from_available: bool = False) -> bool:
        """Could `admit_prompt` take this prompt's blocks: from the reserved pool, or (with
        `from_available`) from A_KVC when the pool is short?"""
        blocks = self.blocks_for(prompt_len)
        return blocks <= self.reserve_left or (from_available and blocks <= self.num_admission_blocks)

    def can_batch(self, seq_id: Hashable, base_tokens: int, predicted_len: int, *, allow_hosting: bool = True) -> bool:
        seq = self._seqs[seq_id]
        reservation = max(self.reservation_tokens(base_tokens, predicted_len), seq.written)
        room = self.num_admission_blocks
        if not seq.resident:
            return self.blocks_for(reservation) <= room
        extra = max(0, self.blocks_for(reservation) - len(seq.table))
        if extra + seq.charged <= room:
            return True
        return (allow_hosting and extra > 0 and seq.charged <= room
                and self._best_host(extra, predicted_len) is not None)

    def can_grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Could `grow` (after `ensure_resident`, if evicted) succeed now, past the table from the reserved pool?"""
        seq = self._seqs[seq_id]
        if not seq.batched:
            return seq.resident and seq.written + num_tokens <= seq.reservation
        blocks = len(seq.table) if seq.resident else self.blocks_for(max(seq.reservation, seq.written))  # restore
        fits = self.blocks_for(seq.written + num_tokens) - blocks <= self.reserve_left
        return fits and (seq.resident or blocks <= self.num_admission_blocks)

    def can_write(self, seq_id: Hashable, end: int) -> bool:
        """`can_grow` to `end` written positions; most calls (a decode inside the table) answer at once."""
        seq = self._seqs[seq_id]
        if seq.resident and end <= len(seq.table) * self.block_size and (seq.batched or end <= seq.reservation):
            return True
        return self.can_grow(seq_id, max(0, end - seq.written))

    # -- mutations: each is all or nothing, raising NoFreeBlocksError and changing nothing -----
    def admit(self, seq_id: Hashable, prompt_len: int, predicted_len: int, *,
              allow_hosting: bool = True) -> Hashable | None:
        """Coupled: reserve prompt + padded RL at once, from A_KVC or in a host's region (§3.4); returns
        the host's id or None. `grow` writes the positions, prompt included."""
        self._check_new(seq_id, prompt_len)
        if predicted_len < 1:
            raise ValueError(f"{seq_id!r}: predicted_len < 1")
        need = self.reservation_tokens(prompt_len, predicted_len)
        blocks = self.blocks_for(need)
        spot = self._best_host(blocks, need) if allow_hosting else None
        if spot is not None:
            seq = _Seq(predicted_len, need, [], 0, prompt_len)
            self._place_in(seq_id, seq, spot)
        elif blocks <= self.num_admission_blocks:
            seq = _Seq(predicted_len, need, [self._free.pop() for _ in range(blocks)], blocks, prompt_len)
        else:
            raise NoFreeBlocksError(f"need {blocks} blocks, {self.num_admission_blocks} free to admit and no host fits")
        self._add(seq_id, seq)
        return seq.host

    def admit_prompt(self, seq_id: Hashable, prompt_len: int, *, from_available: bool = False) -> None:
        """A PT (§3.2.1): "The KVC size allocated to a PT equals its prompt length". Its blocks come
        from the reserved pool ("A small amount KVC is reserved for PTs"), charged to it; with
        `from_available`, a prompt the pool cannot hold takes them from A_KVC instead, uncharged
        ("prompts are selected sequentially to form a batch until the available KVC space is
        fully allocated": `prompt_admissions_available`). Its GT is `batch`ed later."""
        self._check_new(seq_id, prompt_len)
        blocks = self.blocks_for(prompt_len)
        from_pool = blocks <= self.reserve_left
        charged = blocks if from_pool else 0
        if not from_pool and not (from_available and blocks <= self.num_admission_blocks):
            raise NoFreeBlocksError(f"need {blocks} blocks, the reserved pool has {self.reserve_left}"
                                    + (f" and A_KVC {self.num_admission_blocks}" if from_available else ""))
        seq = _Seq(0, prompt_len, [self._free.pop() for _ in range(blocks)], blocks, batched=False, charged=charged)
        self._charged += charged
        self.prompt_admissions += 1
        self.prompt_admissions_available += not from_pool
        self._add(seq_id, seq)
        if prompt_len == 0:
            self._queued.add(seq_id)

    def batch(self, seq_id: Hashable, base_tokens: int, predicted_len: int, *,
              allow_hosting: bool = True) -> list[KVCopy]:
        """Batch a waiting GT (§3.2.1): allocate its predicted RL past `base_tokens` (the tokens it had
        when predicted), padded, in A_KVC or in a host's region (§3.4); its reserved-pool charge moves
        to A_KVC. Returns the loads of a GT that was evicted while it waited."""
        seq = self._seqs[seq_id]
        if seq.batched or predicted_len < 1:
            raise ValueError(f"{seq_id!r}: already batched, or predicted_len < 1")
        if not self.can_batch(seq_id, base_tokens, predicted_len, allow_hosting=allow_hosting):
            raise NoFreeBlocksError(f"{seq_id!r}: no room to batch")
        reservation = max(self.reservation_tokens(base_tokens, predicted_len), seq.written)
        copies: list[KVCopy] = []
        if not seq.resident:
            copies = self._restore(seq_id, seq, self.blocks_for(reservation))
        else:  # a PT or a paused top-level GT (a paused guest was evicted): its own blocks, then its RL part
            assert seq.host is None
            extra = max(0, self.blocks_for(reservation) - len(seq.table))
            hosted = allow_hosting and extra > 0 and seq.charged <= self.num_admission_blocks
            spot = self._best_host(extra, predicted_len) if hosted else None
            if spot is not None:  # hosting first, as for `admit`: A_KVC is kept for what no host holds
                self._place_in(seq_id, seq, spot)
            else:
                seq.table += [self._free.pop() for _ in range(extra)]
                seq.base = len(seq.table)
        self._charged -= seq.charged
        seq.charged, seq.batched, seq.reservation, seq.predicted_len = 0, True, reservation, predicted_len
        seq.base_tokens = base_tokens
        self._queued.discard(seq_id)
        self.batches += 1
        if seq.resident:
            self._lend(seq_id, seq)
        return copies

    def write_within(self, seq_id: Hashable, end: int) -> bool:
        """`grow` to `end` written positions if that takes nothing (resident, inside its table and
        reservation, short of its first guest): most decodes, in one call. False: nothing changed."""
        seq = self._seqs.get(seq_id)
        if seq is None or not seq.resident or end > len(seq.table) * self.block_size or (
                seq.children and self._seqs[seq.children[0]].region_start * self.block_size < end):
            return False
        if not seq.batched:
            if end > seq.reservation:
                return False
            if end == seq.reservation:
                self._queued.add(seq_id)
        seq.written = max(seq.written, end)
        return True

    def grow(self, seq_id: Hashable, num_tokens: int) -> list[KVCopy]:
        """Mark `num_tokens` more positions written; past the allocation, charged to the reserved pool
        (§3.2.2); returns the saves of the guests its writes reach, to run before the forward pass.
        When the pool is short the caller pauses or preempts someone and tries again."""
        seq, copies, size = self._seqs[seq_id], [], self.block_size
        new_written = seq.written + num_tokens
        if not seq.batched:
            if not seq.resident or new_written > seq.reservation:
                raise NoFreeBlocksError(f"{seq_id!r}: not batched: it may write only its reservation")
            seq.written = new_written
            if new_written == seq.reservation:
                self._queued.add(seq_id)
            return []
        extra = -(-new_written // size) - len(seq.table)  # `can_grow`, in O(1) for a resident request
        if not seq.resident or extra > self.reserve_left:
            raise NoFreeBlocksError(f"{seq_id!r}: evicted (call ensure_resident) or the reserved pool is short")
        if seq.children and self._seqs[seq.children[0]].region_start * size < new_written:  # in region order:
            reached = [c for c in seq.children if self._seqs[c].region_start * size < new_written]  # a prefix
            seq.children = seq.children[len(reached):]
            copies = [copy for child_id in reached for copy in self._evict(child_id)]
        if extra > 0:
            seq.table += [self._free.pop() for _ in range(extra)]
            seq.charged += extra
            self._charged += extra
            self.reserved_pool_draws += extra
        seq.written = new_written
        return copies

    def pause(self, seq_id: Hashable) -> list[KVCopy]:
        """Offload-free preemption that keeps the KV (§3.2.2, §2.4): the GT stops, holding the blocks of
        its written tokens (and gives back the rest), and waits to be `batch`ed again. A guest is
        evicted instead (saved, or dropped if the host store is full: `num_written` 0). Returns the
        saves (none for a top-level request that paused for want of room: its writes had passed its
        whole allocation, so no guest was left in it)."""
        seq = self._seqs[seq_id]
        if not seq.batched or not seq.resident:
            raise ValueError(f"{seq_id!r}: only a resident batched request pauses")
        if seq.host is not None:
            # A guest's KV is partly in its host's region, which the host will take back: "r_2 is
            # preempted and its occupied cache will be moved to the main memory" (§3.4), now.
            self._seqs[seq.host].children.remove(seq_id)
            copies = self._evict(seq_id)
        else:
            copies = [copy for child_id in seq.children for copy in self._evict(child_id)]
            seq.children = []
            keep = self.blocks_for(seq.written)
            spare = seq.table[keep:]
            del seq.table[keep:]
            uncharged = min(len(spare), seq.charged)  # the last blocks are the overruns, charged ones
            seq.charged -= uncharged
            self._charged -= uncharged
            self._free += reversed(spare)
            seq.base = min(seq.base, keep)
        seq.batched, seq.reservation = False, seq.written
        self._queued.add(seq_id)
        self.pauses += 1
        return copies

    def preempt(self, seq_id: Hashable, generated: int) -> int:
        """Offload-free preemption that drops the KV (§3.2.2; vLLM's recompute): free the request (its
        guests keep their KV) and return L_new, its prediction with `generated` tokens recomputed as prompt."""
        predicted = self._seqs[seq_id].predicted_len
        self._release(seq_id)
        self.preemptions += 1
        return max(self.config.min_new_prediction, predicted - generated)

    def ensure_resident(self, seq_id: Hashable) -> list[KVCopy]:
        """Bring an evicted batched request back into fresh A_KVC blocks; returns the loads (none if
        resident, or if its KV was dropped: then `num_written` is 0 and the caller recomputes)."""
        seq = self._seqs[seq_id]
        if seq.resident:
            return []
        blocks = self.blocks_for(max(seq.reservation, seq.written))  # the reservation, or all it wrote past it
        if blocks > self.num_admission_blocks:
            raise NoFreeBlocksError(f"need {blocks} blocks, {self.num_admission_blocks} free")
        copies = self._restore(seq_id, seq, blocks)
        self._lend(seq_id, seq)
        return copies

    def free(self, seq_id: Hashable) -> int:
        """Release a finished request (guests keep their KV); returns the device blocks freed, 0 if unknown."""
        return self._release(seq_id) if seq_id in self._seqs else 0

    # -- internals -----------------------------------------------------------------------
    def _check_new(self, seq_id: Hashable, prompt_len: int) -> None:
        if seq_id in self._seqs or prompt_len < 0:
            raise ValueError(f"{seq_id!r}: admitted twice, or prompt_len < 0")

    def _add(self, seq_id: Hashable, seq: _Seq) -> None:
        seq.order, self._seqs[seq_id] = self.admissions, seq
        self.admissions += 1
        if seq.batched:
            self._lend(seq_id, seq)

    def _place_in(self, seq_id: Hashable, seq: _Seq, spot: tuple[Hashable, int, int]) -> None:
        """Append the host's region [start, end) to `seq`'s table, as its allocation's end."""
        host_id, start, end = spot
        host = self._seqs[host_id]
        seq.lent_from = len(seq.table)
        seq.table += host.table[start:end]
        seq.base, seq.host, seq.region_start = len(seq.table), host_id, start
        host.children.insert(0, seq_id)  # its region ends where the first guest's begins
        self.hosted_placements += 1
        self.num_guests += 1

    def _restore(self, seq_id: Hashable, seq: _Seq, blocks: int) -> list[KVCopy]:
        seq.table, seq.base, seq.lent_from, seq.resident = [self._free.pop() for _ in range(blocks)], blocks, 0, True
        self.restores += 1
        if seq.written == 0:
            return []
        assert self.host_store is not None  # written K/V survives an eviction only in the host store
        # Its latest save: each save appends its blocks to the request's host blocks, and earlier
        # saves (restored from before, now stale) stay held until it is released (`_release`).
        latest = self.host_store.blocks_of(seq_id)[-self.blocks_for(seq.written):]
        saved = self._slots(latest, 0, seq.written)
        return [KVCopy("load", tuple(saved), tuple(self.slot_mapping(seq_id, 0, seq.written)), reader=seq_id)]

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Position p lives at slot `table[p // B] * B + p % B`, as in `BlockPool` (and the host store)."""
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]

    def _owned(self, seq: _Seq) -> list[int]:
        """Lent blocks stay the lender's: a guest owns its blocks before and past its region."""
        return seq.table if seq.host is None else seq.table[:seq.lent_from] + seq.table[seq.base:]

    def _lend(self, seq_id: Hashable, seq: _Seq) -> None:
        """Index a resident batched request as a possible host (`_best_host`); rebuilt when mostly stale."""
        if len(self._lenders) > 2 * len(self._seqs) + 64:
            self._lenders = sorted((s.written - s.base * self.block_size, s.order, i)
                                   for i, s in self._seqs.items() if s.resident and s.batched)
        heapq.heappush(self._lenders, (seq.written - seq.base * self.block_size, seq.order, seq_id))

    def _best_host(self, blocks: int, steps: int) -> tuple[Hashable, int, int] | None:
        """The tightest (host, start, end) region, in host blocks, that holds `blocks` and outlasts `steps`
        tokens plus the host's b (the §3.4 rule; ties: the earliest admitted). A region is at most half of
        base * B - written, which only shrinks as its host writes: `_lenders` holds that (negated) as of
        some earlier call, so only its entries of 2 * blocks * B or more are looked at, and pushed back fresh."""
        size, best = self.block_size, None
        hosts: dict[Hashable, None] = {}
        while self._lenders and -self._lenders[0][0] >= 2 * blocks * size:
            hosts[heapq.heappop(self._lenders)[2]] = None  # a host's older entries too: it is looked at once
        for host_id in hosts:
            host = self._seqs.get(host_id)
            if host is None or not host.resident or not host.batched:
                continue  # gone, evicted or paused: `batch`/`ensure_resident` index it again
            self._lend(host_id, host)
            if host.written < host.base_tokens:
                continue  # still prefilling: its writes are not one per step yet
            end = self._seqs[host.children[0]].region_start if host.children else host.base
            start = -(-(host.written + end * size) // (2 * size))
            if host.host is not None:  # a nested host lends only from its own region
                start = max(start, host.lent_from)
            fits = (blocks <= end - start
                    and steps + self.pipeline_buffer(host.predicted_len) <= start * size - host.written)
            if fits and (best is None or (end - start, host.order) < best[0]):
                best = ((end - start, host.order), (host_id, start, end))
        return best and best[1]

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
        self._free += reversed(self._owned(seq))
        self._charged -= seq.charged
        self.num_guests -= seq.host is not None
        seq.table, seq.children, seq.host, seq.resident, seq.charged, seq.lent_from = [], [], None, False, 0, 0
        return copies

    def _release(self, seq_id: Hashable) -> int:
        seq = self._seqs.pop(seq_id)
        self._queued.discard(seq_id)
        if self.host_store is not None:
            # A restored request's saved KV, kept until now: a save issued in the step that
            # restored it runs before the load and must never land on those host blocks.
            self.host_store.free(seq_id)
        if not seq.resident:
            return 0
        self._charged -= seq.charged
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
                child.host, child.region_start = seq.host, seq.region_start + child.region_start - seq.lent_from
            else:  # the region was ours: the guest now owns it
                child.host = None
                adopted.update(child.table[child.lent_from:child.base])
        released = [b for b in self._owned(seq) if b not in adopted]
        self._free += reversed(released)
        return len(released)

    # -- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        owned = [b for s in self._seqs.values() if s.resident for b in self._owned(s)]
        assert sorted(owned + self._free) == list(range(self.num_blocks)), "blocks lost, invented, or owned twice"
        assert self._charged == sum(s.charged for s in self._seqs.values()), "the reserved pool's charge is off"
        assert 0 <= self.reserve_left and self.num_admission_blocks >= 0, "the reserved pool overdrawn"
        assert self._queued == {i for i, s in self._seqs.items() if not s.batched and s.written >= s.reservation}, \
            "`queued` is not the unbatched requests done writing"
        slots: list[int] = []
        # each id's least key
        keys = {seq_id: key for key, _, seq_id in sorted(self._lenders, key=lambda e: -e[0])}
        for seq_id, seq in self._seqs.items():
            if not seq.resident:
                assert not seq.table and not seq.children and seq.host is None and not seq.charged, \
                    f"{seq_id!r}: evicted but holds device state"
                saved = len(self.host_store.blocks_of(seq_id)) if self.host_store is not None else 0
                assert saved >= self.blocks_for(seq.written), f"{seq_id!r}: written KV neither saved nor dropped"
                continue
            assert len(seq.table) * self.block_size >= seq.written, \
                f"{seq_id!r}: table does not cover the written positions"
            assert seq.lent_from <= seq.base <= len(seq.table)
            if seq.batched:
                assert seq.charged == len(seq.table) - seq.base, f"{seq_id!r}: charge is not its overrun"
                assert keys.get(seq_id, math.inf) <= seq.written - seq.base * self.block_size, \
                    f"{seq_id!r}: missing from `_lenders`"
            else:
                assert seq.written <= seq.reservation <= len(seq.table) * self.block_size, \
                    f"{seq_id!r}: wrote past its reservation"
                assert not seq.children and seq.charged <= len(self._owned(seq)), \
                    f"{seq_id!r}: unbatched host, or overcharged"
            slots += self.slot_mapping(seq_id, 0, seq.written)
            assert seq.host is None or seq_id in self._seqs[seq.host].children, \
                f"{seq_id!r}: host does not know its guest"
            edge = self.blocks_for(seq.written)
            for child_id in seq.children:
                child = self._seqs[child_id]
                assert child.resident and child.host == seq_id, f"{child_id!r}: wrong host link"
                assert child.region_start >= edge, \
                    f"{child_id!r}: region overlaps the host's written part or a sibling"
                assert seq.host is None or child.region_start >= seq.lent_from, \
                    f"{child_id!r}: outside its nested host's region"
                edge = child.region_start + child.base - child.lent_from
                assert child.table[child.lent_from:child.base] == seq.table[child.region_start:edge], \
                    f"{child_id!r}: region is not the host's blocks"
                assert edge <= seq.base, f"{child_id!r}: region outside the host's allocation"
        assert len(slots) == len(set(slots)), "two live positions share a KV slot"
        assert self.num_guests == sum(s.host is not None for s in self._seqs.values()), "num_guests is off"
        assert self._seqs or (len(self._free) == self.num_blocks and not self._charged), \
            "blocks leaked with no requests left"
