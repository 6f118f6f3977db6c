"""Exact KV allocation from predicted response lengths (EcoServe: ecoserve.txt §2.3, §3.2, §3.4).

Admission reserves, all at once, blocks for `prompt + ceil(RL * (1 + padding_ratio))` tokens
(§2.3 padding, §3.2.1 exact allocation); growing inside them never allocates. Position p of a
request lives at slot `table[p // B] * B + p % B`, as in `BlockPool`.

Under-prediction (§3.2.2): blocks past the reservation come from a reserved pool,
`reserved_fraction` of all blocks, which admission never touches. When it cannot cover a growth,
the request is preempted without offloading: its blocks are freed and `grow` raises `Preempted`
with `L_new = max(min_new_prediction, predicted - generated)`; the scheduler recomputes its
prompt and generated tokens. As in the paper, nothing else is tried first.

KV pipelining (§3.4), as we read it. A resident request H with `w` written tokens can lend the
gap between its write head and its first guest's region (or the end of its original allocation,
block `end`). The region starts at the block holding the gap's midpoint,
`start = ceil((w + end * B) / 2B)`, and runs to `end`. A request needing `need` = prompt + padded
RL slots is hosted there if it fits, `need <= (end - start) * B`, and is predicted to finish `b`
tokens before H's writes arrive, `need + b <= start * B - w`: the paper's "RL below half the
host's RL minus b", measured on the unused space so a request part way through can host, and
counting the prompt, conservatively, as steps. The tightest fitting region wins ("closest to
half"). A guest can host in its own region (Fig. 9b's nesting dolls), and the host's next guest
lands in the second half of its shrunken gap (r3 at L/4..L/2). Only original allocations are
lent, never reserved-pool blocks. When H's writes reach a region, the guest and everything nested
in it are evicted: written KV is saved to host blocks the guest owns (`KVCopy("save")`), or, with
no host room, dropped (`num_written` becomes 0: recompute). `ensure_resident` gives an evicted
request fresh blocks and returns the loads; its host blocks stay its own until `free`, because a
save issued in the same step runs before the load and must never land on them. A departing host's
guests keep their KV in place: a top-level host's guest takes ownership of its region, a hosted
host's guest is re-lent by the host's own host.

Ownership: a block is owned by the request that drew it from a pool; lent blocks stay the
lender's. A top-level request owns its whole table, a guest only the blocks past its region.

Invariants (checked by `check_invariants`):
  1. Conservation: free + reserved pool + owned == total, no block in two places (lent blocks
     count once, for their owner). The reserved pool never exceeds its target.
  2. Each resident table covers its written positions; an evicted request holds no device blocks
     and its written positions are all saved in host blocks it owns.
  3. A guest's region is its host's blocks [start, start + len) of the host's table, past the
     host's written blocks, inside its original allocation, and regions don't overlap.
  4. No two live written positions share a device slot.
  5. With no requests, the reserved pool is full and every other block is free: nothing leaked.
"""
from __future__ import annotations

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
        if self.block_size < 1 or self.padding_ratio < 0 or self.pipeline_buffer < 0:
            raise ValueError("block_size must be positive, padding_ratio and pipeline_buffer >= 0")
        if not 0 <= self.reserved_fraction < 1 or self.min_new_prediction < 1:
            raise ValueError("reserved_fraction must be in [0, 1) and min_new_prediction >= 1")


class Preempted(RuntimeError):
    """Offload-free preemption (§3.2.2): the request's KV is freed; re-enqueue it with
    `new_predicted_len`, recomputing its prompt and its `generated` tokens."""

    def __init__(self, seq_id: Hashable, prompt_len: int, generated: int, new_predicted_len: int):
        super().__init__(f"{seq_id!r} preempted after {generated} generated tokens; L_new={new_predicted_len}")
        self.seq_id, self.prompt_len = seq_id, prompt_len
        self.generated, self.new_predicted_len = generated, new_predicted_len


@dataclass(eq=False)
class _Seq:
    prompt_len: int
    predicted_len: int
    reservation: int                 # token slots promised at admission
    table: list[int]
    base: int                        # blocks of the original allocation: the only hostable part
    written: int = 0
    host: Hashable | None = None
    region_start: int = 0            # where table[0] sits in the host's table, in blocks
    children: list[Hashable] = field(default_factory=list)  # hosted requests, by region_start
    resident: bool = True


class ExactAllocator:
    def __init__(self, num_blocks: int, config: ExactAllocConfig, host_store: HostKVStore | None = None):
        if num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        if host_store is not None and host_store.block_size != config.block_size:
            raise ValueError("the host store must use the same block size")
        self.num_blocks, self.config, self.block_size = num_blocks, config, config.block_size
        self.host_store = host_store
        self.reserve_target = int(num_blocks * config.reserved_fraction)
        stack = list(range(num_blocks - 1, -1, -1))  # stacks: low ids are handed out first
        self._reserve, self._free = stack[:self.reserve_target], stack[self.reserve_target:]
        self._seqs: dict[Hashable, _Seq] = {}
        # Counters, so tests and benchmarks can see which mechanism ran.
        self.admissions = self.hosted_placements = self.reserved_pool_draws = self.preemptions = 0
        self.hosted_evictions = self.hosted_drops = self.restores = 0

    # -- queries -------------------------------------------------------------------------
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
        """A copy; empty while the request is evicted."""
        return list(self._seqs[seq_id].table)

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Flat cache slots of written positions [start, end): past the write head may be a guest's."""
        seq, size = self._seqs[seq_id], self.block_size
        if end > seq.written or not seq.resident:
            raise IndexError(f"{seq_id!r}: positions up to {end} are not written and resident")
        return [seq.table[p // size] * size + p % size for p in range(start, end)]

    # -- mutations -----------------------------------------------------------------------
    def admit(self, seq_id: Hashable, prompt_len: int, predicted_len: int, *, allow_hosting: bool = True) -> Hashable | None:
        """Reserve the whole predicted footprint; returns the host's id when hosted (§3.4), else None.

        All or nothing: raises NoFreeBlocksError, changing nothing, when neither a host nor the
        admission pool has room. Positions are written (and counted) by `grow`, prompt included.
        """
        if seq_id in self._seqs:
            raise ValueError(f"{seq_id!r} is already admitted")
        if prompt_len < 0 or predicted_len < 1:
            raise ValueError("prompt_len must be >= 0 and predicted_len >= 1")
        need = self.reservation_tokens(prompt_len, predicted_len)
        spot = self._best_host(need) if allow_hosting else None
        if spot is not None:
            host_id, start, end = spot
            host = self._seqs[host_id]
            seq = _Seq(prompt_len, predicted_len, need, host.table[start:end], end - start, host=host_id, region_start=start)
        else:
            blocks = self.blocks_for(need)
            if blocks > len(self._free):
                raise NoFreeBlocksError(f"need {blocks} blocks, {len(self._free)} free and no host fits")
            seq = _Seq(prompt_len, predicted_len, need, [self._free.pop() for _ in range(blocks)], blocks)
        self._seqs[seq_id] = seq
        if spot is not None:
            host.children.append(seq_id)
            self._sort_children(host)
            self.hosted_placements += 1
        self.admissions += 1
        return seq.host

    def grow(self, seq_id: Hashable, num_tokens: int) -> list[KVCopy]:
        """Mark `num_tokens` more positions written; returns the saves of evicted guests.

        Run the copies before the forward pass writes the new positions. Raises `Preempted`
        (the request is gone, its guests keep their KV) when the reserved pool cannot cover it.
        """
        seq = self._resident(seq_id)
        new_written = seq.written + num_tokens
        extra = self.blocks_for(new_written) - len(seq.table)
        if extra > len(self._reserve):
            generated = max(0, seq.written - seq.prompt_len)
            self._release(seq_id)
            self.preemptions += 1
            new_len = max(self.config.min_new_prediction, seq.predicted_len - generated)
            raise Preempted(seq_id, seq.prompt_len, generated, new_len)
        copies: list[KVCopy] = []
        for child_id in [c for c in seq.children if self._seqs[c].region_start * self.block_size < new_written]:
            seq.children.remove(child_id)
            copies += self._evict(child_id)
        if extra > 0:
            seq.table += [self._reserve.pop() for _ in range(extra)]
            self.reserved_pool_draws += extra
        seq.written = new_written
        return copies

    def ensure_resident(self, seq_id: Hashable) -> list[KVCopy]:
        """Bring an evicted request back into fresh blocks; returns the loads (none if resident).

        If its KV was dropped, `num_written` is 0 and the caller recomputes it. Raises
        NoFreeBlocksError, changing nothing, when the admission pool is short.
        """
        seq = self._seqs[seq_id]
        if seq.resident:
            return []
        blocks = self.blocks_for(max(seq.reservation, seq.written))
        if blocks > len(self._free):
            raise NoFreeBlocksError(f"need {blocks} blocks, {len(self._free)} free")
        seq.table, seq.base, seq.resident = [self._free.pop() for _ in range(blocks)], blocks, True
        self.restores += 1
        if seq.written == 0:
            return []
        saved, size = self.host_store.blocks_of(seq_id), self.block_size
        src = tuple(saved[p // size] * size + p % size for p in range(seq.written))
        return [KVCopy("load", src, tuple(self.slot_mapping(seq_id, 0, seq.written)))]

    def free(self, seq_id: Hashable) -> int:
        """Release a finished request (guests keep their KV); returns the device blocks freed.
        Freeing an unknown id is a no-op."""
        return self._release(seq_id) if seq_id in self._seqs else 0

    # -- internals -----------------------------------------------------------------------
    def _resident(self, seq_id: Hashable) -> _Seq:
        seq = self._seqs[seq_id]
        if not seq.resident:
            raise RuntimeError(f"{seq_id!r} is evicted: call ensure_resident first")
        return seq

    def _owned(self, seq: _Seq) -> list[int]:
        return seq.table if seq.host is None else seq.table[seq.base:]

    def _sort_children(self, seq: _Seq) -> None:
        seq.children.sort(key=lambda c: self._seqs[c].region_start)

    def _best_host(self, need: int) -> tuple[Hashable, int, int] | None:
        """The tightest (host, start, end) region, in host blocks, that fits the §3.4 rule."""
        size, best = self.block_size, None
        for host_id, host in self._seqs.items():
            if not host.resident:
                continue
            end = self._seqs[host.children[0]].region_start if host.children else host.base
            start = -(-(host.written + end * size) // (2 * size))
            fits = need <= (end - start) * size and need + self.config.pipeline_buffer <= start * size - host.written
            if fits and (best is None or end - start < best[2] - best[1]):
                best = (host_id, start, end)
        return best

    def _give_back(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # refill the reserved pool first: it guards running requests
            (self._reserve if len(self._reserve) < self.reserve_target else self._free).append(block)

    def _evict(self, seq_id: Hashable) -> list[KVCopy]:
        """Save (or drop) `seq_id` and everything nested in it; the lent blocks stay with the lender."""
        seq, copies = self._seqs[seq_id], []
        for child_id in seq.children:
            copies += self._evict(child_id)
        self.hosted_evictions += 1
        try:
            if self.host_store is None:
                raise NoFreeBlocksError("no host store")
            saved = self.host_store.allocate(seq_id, self.blocks_for(seq.written))
        except NoFreeBlocksError:
            seq.written, saved = 0, []
            self.hosted_drops += 1
        if seq.written:
            size = self.block_size
            dst = tuple(saved[p // size] * size + p % size for p in range(seq.written))
            copies.append(KVCopy("save", tuple(self.slot_mapping(seq_id, 0, seq.written)), dst))
        self._give_back(self._owned(seq))
        seq.table, seq.children, seq.host, seq.resident = [], [], None, False
        return copies

    def _release(self, seq_id: Hashable) -> int:
        seq = self._seqs.pop(seq_id)
        if self.host_store is not None:
            self.host_store.free(seq_id)  # a restored request's checkpoint
        if not seq.resident:
            return 0
        host = self._seqs[seq.host] if seq.host is not None else None
        adopted: set[int] = set()
        if host is not None:
            host.children.remove(seq_id)
        for child_id in seq.children:
            child = self._seqs[child_id]
            if host is not None:  # the region was lent to us: our host lends it on directly
                child.host, child.region_start = seq.host, seq.region_start + child.region_start
                host.children.append(child_id)
            else:  # the region was ours: the guest now owns it
                child.host = None
                adopted.update(child.table[:child.base])
        if host is not None:
            self._sort_children(host)
        released = [b for b in self._owned(seq) if b not in adopted]
        self._give_back(released)
        return len(released)

    # -- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        size = self.block_size
        owned = [b for s in self._seqs.values() if s.resident for b in self._owned(s)]
        every = owned + self._free + self._reserve
        assert len(every) == self.num_blocks and set(every) == set(range(self.num_blocks)), \
            "blocks lost, invented, or owned twice"
        assert len(self._reserve) <= self.reserve_target, "the reserved pool overflowed"
        slots: list[int] = []
        for seq_id, seq in self._seqs.items():
            if not seq.resident:
                assert not seq.table and not seq.children and seq.host is None, f"{seq_id!r}: evicted but holds device state"
                saved = self.host_store.blocks_of(seq_id) if self.host_store is not None else []
                assert len(saved) >= self.blocks_for(seq.written), f"{seq_id!r}: written KV neither saved nor dropped"
                continue
            assert len(seq.table) * size >= seq.written, f"{seq_id!r}: table does not cover the written positions"
            assert seq.base <= len(seq.table)
            slots += self.slot_mapping(seq_id, 0, seq.written)
            if seq.host is not None:
                assert seq_id in self._seqs[seq.host].children, f"{seq_id!r}: host does not know its guest"
            edge = self.blocks_for(seq.written)
            for child_id in seq.children:
                child = self._seqs[child_id]
                assert child.resident and child.host == seq_id, f"{child_id!r}: wrong host link"
                assert child.region_start >= edge, f"{child_id!r}: region overlaps the host's written part or a sibling"
                edge = child.region_start + child.base
                assert child.table[:child.base] == seq.table[child.region_start:edge], f"{child_id!r}: region is not the host's blocks"
                assert edge <= seq.base, f"{child_id!r}: region outside the host's original allocation"
        assert len(slots) == len(set(slots)), "two live positions share a KV slot"
        if not self._seqs:
            assert len(self._reserve) == self.reserve_target and len(self._free) == self.num_blocks - self.reserve_target, \
                "blocks leaked with no requests left"
