"""Incremental KV checkpointing with adaptive rate and background prefetch (ConServe, conserve.txt §4.4).

Swapping a victim's KV out at preemption time blocks the request that needed the memory. ConServe
instead copies each sequence's newly *completed* blocks to host memory after every iteration, so
the traffic is amortised over many steps and preempting a checkpointed sequence is only freeing
its device blocks. A full block is never written again (decode appends), so its host copy stays
valid until the sequence ends; the partly filled tail block is never saved and is recomputed.

The rate (§4.4, "Adaptive Checkpointing Policy"): ConServe "starts checkpointing when available
GPU memory is running low (by default the threshold is set to 50%)", "will only checkpoint a small
number of offline requests first and gradually increase the number of offline requests to
checkpoint", and "always tries to match checkpointing speed with memory consumption speed". Per
step (`plan_step`), once device KV usage reaches `threshold`, a share of the reported sequences is
chosen, and *all* their unsaved full blocks are saved (so a chosen sequence's checkpoint keeps up
with what each step makes resident, however large the step's prefill), within the step's link
budget (`max_blocks`: §4.5 "uses the SLO to decide the maximum number of KV cache blocks that can
be swapped in the background, and defers the extra blocks to the next round") and as long as the
host has room (when it does not, less is saved; the planner never fails).
  assumption: "gradually increase the number of requests" is read as random early detection's
  linear ramp (§4.4 cites RED): one sequence at the threshold, rising linearly to all of them at
  100% usage. `max_blocks_per_step` optionally caps the budget further (None: the link decides).
Which sequences: the caller's `order` first (the policy knows who it will preempt first), then
sequences that already hold a checkpoint (keeping the chosen set stable so those stay cheap to
preempt), then the ones with most unsaved full blocks.

`preempt` frees the device blocks at once and keeps the host copy. Restoring it is split (§4.4,
"Background Prefetching": "split the swap-in phase over multiple steps"): `start_prefetch`
allocates fresh device blocks for the saved prefix, and `load` issues the loads of the next few
blocks, step after step (`prefetch` does both at once). Each load names the sequence as its
reader: the forward that runs it waits for whatever has not landed, nothing else does. Meanwhile
the sequence is *restoring*: resident, with `unloaded_blocks` host blocks not yet sent; preempting
it again just frees those blocks. A resumed sequence keeps its host copy, so a second preemption is
free again.

Saves are asynchronous ("checkpointing has no data dependency with follow-up computation, it can
be done asynchronously in the background and overlapped with computation", §4.4): nobody waits
for them. So the checkpointer tracks each of its copies until the host store's ledger reports it
landed (memory/copies.py; the scheduler polls at every step's start):
- a device block an in-flight save reads, or an in-flight load writes, is never handed to anyone
  else: if its sequence is preempted or released meanwhile, the block is *held* in the pool and
  freed when the copy lands;
- a host copy is read only after its save landed: a preempted sequence with a save in flight is
  not resumable (`can_resume` is False) until it lands, though it keeps those tokens.
Copies land in issue order (one copy stream, one link), so host blocks need no holding: a save
into a host block that a released sequence's copy still reads or writes is issued after it.
The checkpointer is the host store's only client (it owns host blocks under the sequence ids).
`CheckpointKV` (checkpoint_kv.py) drives it from the scheduler: the step's saves are its first
copy group, spending the step's link budget first; prefetch loads (issued steps ahead of the
sequence's resumption, or in it if still missing) get what is left.

Invariants (checked by `check_invariants`):
  1. The host store's owners are exactly the tracked sequences, each holding exactly the host
     blocks recorded for it (so free + owned == total on the host too).
  2. A tracked sequence's saved blocks never exceed its full blocks (computed tokens // B).
  3. Saved host block i holds device block i: a resident sequence has at least as many device
     blocks as saved ones; a preempted one has none in the pool. A restoring sequence (resident,
     loads not all issued) holds exactly its saved tokens, and only a resident one is restoring.
  4. Both pools keep their own invariants (conservation, no block in two places).
  5. With nothing tracked every host block is free; with no sequences every device block is.
  6. The pool's held blocks are exactly those held for the checkpointer's in-flight copies; a
     tracked sequence's in-flight copies are known to it; a resident sequence's in-flight copies
     touch only its own blocks.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.copies import device_slots
from nanoserve.memory.host import HostKVStore, KVCopy


@dataclass(frozen=True)
class CheckpointConfig:
    # Device KV usage (used / total blocks) at which checkpointing starts.
    threshold: float = 0.5
    # An optional hard cap on the blocks saved per step, on top of the link budget the caller
    # passes to `plan_step` (None: no cap beyond it).
    max_blocks_per_step: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError("threshold is a fraction of device KV blocks, in [0, 1]")
        if self.max_blocks_per_step is not None and self.max_blocks_per_step < 0:
            raise ValueError("max_blocks_per_step must be >= 0 (or None)")


@dataclass
class _Checkpoint:
    host_blocks: list[int]  # host_blocks[i] holds (once its save lands) the sequence's device block i
    num_tokens: int  # computed tokens last reported (saved tokens while preempted)
    resident: bool = True
    # Restoring: how many leading saved blocks have their loads issued; None once all have (or
    # for a sequence that was never preempted).
    loads_issued: int | None = None
    in_flight: set[int] = field(default_factory=set)  # tickets of its saves and loads not yet landed


class IncrementalCheckpointer:
    def __init__(self, pool: BlockPool, store: HostKVStore, config: CheckpointConfig = CheckpointConfig()):
        if pool.block_size != store.block_size:
            raise ValueError("device and host blocks must hold the same number of slots")
        self.pool, self.store, self.config = pool, store, config
        self._tracked: dict[Hashable, _Checkpoint] = {}
        self._touching: dict[int, list[int]] = {}  # in-flight ticket -> device blocks it reads or writes
        self._holding: set[int] = set()  # in-flight tickets whose blocks left their table: held in the pool
        # Counters, so a caller (or test) can tell a mechanism actually ran.
        self.blocks_checkpointed = 0
        self.preemptions_with_checkpoint = 0
        self.prefetches = 0
        self.blocks_prefetched = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """Bytes one block copy moves: K and V of every layer for B slots."""
        k = self.store.k
        return 2 * k.shape[0] * self.store.block_size * k.shape[2] * k.shape[3] * k.element_size()

    @property
    def device_usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def share_to_checkpoint(self) -> float:
        """Fraction of reported sequences to checkpoint now: 0 below the threshold, rising
        linearly to 1 at full usage (`plan_step` always takes at least one once it is reached)."""
        usage, threshold = self.device_usage, self.config.threshold
        if usage < threshold:
            return 0.0
        if threshold >= 1.0:
            return 1.0
        return min(1.0, (usage - threshold) / (1.0 - threshold))

    def saved_blocks(self, seq_id: Hashable) -> int:
        entry = self._tracked.get(seq_id)
        return len(entry.host_blocks) if entry else 0

    def saved_tokens(self, seq_id: Hashable) -> int:
        """Leading tokens of `seq_id` whose KV is (or, once this step's copies run, will be) on host."""
        return self.saved_blocks(seq_id) * self.pool.block_size

    def is_preempted(self, seq_id: Hashable) -> bool:
        entry = self._tracked.get(seq_id)
        return entry is not None and not entry.resident

    def can_resume(self, seq_id: Hashable) -> bool:
        """A preempted sequence may be prefetched once every save of its checkpoint landed."""
        entry = self._tracked.get(seq_id)
        return entry is not None and not entry.resident and not entry.in_flight

    def unloaded_blocks(self, seq_id: Hashable) -> int:
        """Saved blocks whose loads are still to be issued: all of them for a preempted sequence,
        the rest of them for a restoring one, 0 for a resident one."""
        entry = self._tracked.get(seq_id)
        if entry is None or (entry.resident and entry.loads_issued is None):
            return 0
        return len(entry.host_blocks) - (entry.loads_issued or 0)

    def is_restoring(self, seq_id: Hashable) -> bool:
        entry = self._tracked.get(seq_id)
        return entry is not None and entry.loads_issued is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._touching)

    # -- per-step planning ------------------------------------------------------------------
    def plan_step(self, num_tokens_by_seq: Mapping[Hashable, int], order: Sequence[Hashable] | None = None,
                  max_blocks: int | None = None) -> list[KVCopy]:
        """Save ops for the chosen sequences' full blocks not yet saved, at most `max_blocks` of
        them (the step's link budget; None: no budget).

        `num_tokens_by_seq` maps each sequence that ran to its tokens whose KV is computed on the
        device (not merely reserved); `order` optionally ranks sequences, first = checkpoint first.
        """
        size = self.pool.block_size
        resident: dict[Hashable, int] = {}
        for seq_id, num_tokens in num_tokens_by_seq.items():
            if not self.pool.has(seq_id) or self.is_preempted(seq_id) or self.is_restoring(seq_id):
                continue
            table = self.pool.block_table(seq_id)
            if num_tokens > len(table) * size:
                raise ValueError(f"{seq_id!r}: {num_tokens} computed tokens exceed its {len(table) * size} slots")
            if num_tokens // size < self.saved_blocks(seq_id):
                raise ValueError(f"{seq_id!r}: {num_tokens} computed tokens, fewer than already saved")
            resident[seq_id] = num_tokens
            if seq_id in self._tracked:
                self._tracked[seq_id].num_tokens = num_tokens

        if not resident or self.device_usage < self.config.threshold:
            return []
        num_chosen = max(1, math.ceil(self.share_to_checkpoint() * len(resident)))
        rank = {seq_id: i for i, seq_id in enumerate(order or ())}
        unsaved = {s: n // size - self.saved_blocks(s) for s, n in resident.items()}
        chosen = sorted(resident, key=lambda s: (rank.get(s, len(rank)), s not in self._tracked, -unsaved[s]))
        chosen = chosen[:num_chosen]

        copies: list[KVCopy] = []
        caps = [c for c in (self.config.max_blocks_per_step, max_blocks) if c is not None]
        budget = min(caps) if caps else self.pool.num_blocks
        for seq_id in chosen:
            count = min(unsaved[seq_id], budget, self.store.num_free_blocks)
            if count <= 0:
                continue
            copies.append(self._save(seq_id, resident[seq_id], count))
            budget -= count
        return copies

    def _save(self, seq_id: Hashable, num_tokens: int, count: int) -> KVCopy:
        entry = self._tracked.setdefault(seq_id, _Checkpoint(host_blocks=[], num_tokens=num_tokens))
        first = len(entry.host_blocks)
        device_blocks = self.pool.block_table(seq_id)[first:first + count]
        host_blocks = self.store.allocate(seq_id, count)
        entry.host_blocks.extend(host_blocks)
        self.blocks_checkpointed += count
        src, dst = device_slots(device_blocks, self.pool.block_size), self.store.slots_of(host_blocks)
        return self._track(seq_id, KVCopy("save", src, dst), device_blocks)

    def _track(self, seq_id: Hashable, copy: KVCopy, device_blocks: list[int]) -> KVCopy:
        self._touching[copy.ticket] = list(device_blocks)
        self._tracked[seq_id].in_flight.add(copy.ticket)
        self.store.inflight.when_landed(copy, lambda: self._landed(seq_id, copy.ticket))
        return copy

    def _landed(self, seq_id: Hashable, ticket: int) -> None:
        blocks = self._touching.pop(ticket)
        entry = self._tracked.get(seq_id)
        if entry is not None:
            entry.in_flight.discard(ticket)
        if ticket in self._holding:
            self._holding.discard(ticket)
            self.pool.unhold(blocks)

    def _free_device(self, seq_id: Hashable, entry: _Checkpoint | None) -> None:
        """Free the sequence's device blocks, holding those its in-flight copies still touch."""
        tickets = entry.in_flight if entry is not None else set()
        self._holding |= tickets
        self.pool.free(seq_id, hold=[b for ticket in tickets for b in self._touching[ticket]])

    # -- preemption and resume --------------------------------------------------------------
    def preempt(self, seq_id: Hashable) -> int:
        """Free `seq_id`'s device blocks now, without copying; returns the tokens kept on host.

        Tokens past the returned count (the unsaved tail) must be recomputed. With nothing saved
        the sequence is forgotten entirely, as if it had never run.
        """
        if self.is_preempted(seq_id):
            raise ValueError(f"{seq_id!r} is already preempted")
        entry = self._tracked.get(seq_id)
        self._free_device(seq_id, entry)
        if entry is None:
            return 0
        if entry.loads_issued is None:  # not a restoring one given up again
            self.preemptions_with_checkpoint += 1
        entry.resident, entry.loads_issued = False, None
        entry.num_tokens = len(entry.host_blocks) * self.pool.block_size
        return entry.num_tokens

    def start_prefetch(self, seq_id: Hashable) -> None:
        """Give a preempted `seq_id` fresh device blocks for its saved tokens; it is restoring
        until `load` has issued every block's load. All or nothing: raises NoFreeBlocksError
        (changing nothing) if the pool cannot hold the saved tokens (check with
        `pool.can_allocate(seq_id, saved_tokens(seq_id))`), ValueError if a save of its
        checkpoint is still in flight (`can_resume`)."""
        entry = self._tracked.get(seq_id)
        if entry is None or entry.resident:
            raise ValueError(f"{seq_id!r} is not a preempted sequence with a checkpoint")
        if entry.in_flight:
            raise ValueError(f"{seq_id!r}: its checkpoint has saves in flight; it resumes once they land")
        self.pool.allocate(seq_id, entry.num_tokens)
        entry.resident, entry.loads_issued = True, 0
        self.prefetches += 1

    def load(self, seq_id: Hashable, max_blocks: int | None = None) -> list[KVCopy]:
        """Issue the loads of a restoring `seq_id`'s next `max_blocks` saved blocks (None: all
        that are left); they name it as their reader. [] if none are left."""
        entry = self._tracked.get(seq_id)
        if entry is None or not entry.resident:
            raise ValueError(f"{seq_id!r} is not restoring: start_prefetch first")
        if entry.loads_issued is None:
            return []
        first = entry.loads_issued
        count = len(entry.host_blocks) - first
        if max_blocks is not None:
            count = min(count, max_blocks)
        entry.loads_issued = None if first + count == len(entry.host_blocks) else first + count
        if count <= 0:
            return []
        self.blocks_prefetched += count
        device_blocks = self.pool.block_table(seq_id)[first:first + count]
        src = self.store.slots_of(entry.host_blocks[first:first + count])
        dst = device_slots(device_blocks, self.pool.block_size)
        return [self._track(seq_id, KVCopy("load", src, dst, reader=seq_id), device_blocks)]

    def prefetch(self, seq_id: Hashable) -> list[KVCopy]:
        """`start_prefetch` and every load at once: afterwards the sequence is resident with
        `saved_tokens(seq_id)` computed tokens, and the forward that runs it waits for the loads."""
        self.start_prefetch(seq_id)
        return self.load(seq_id)

    def release(self, seq_id: Hashable) -> None:
        """`seq_id` finished or was dropped: free its device blocks (holding those an in-flight
        copy touches) and its checkpoint."""
        entry = self._tracked.pop(seq_id, None)
        self._free_device(seq_id, entry)
        if entry is not None:
            self.store.free(seq_id)

    # -- invariants --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.store.check_invariants()
        size = self.pool.block_size
        host_owned = self.store.num_blocks - self.store.num_free_blocks
        assert host_owned == sum(len(e.host_blocks) for e in self._tracked.values()), \
            "host blocks held by someone the checkpointer does not track"
        for seq_id, entry in self._tracked.items():
            assert entry.host_blocks, f"{seq_id!r} tracked with nothing saved"
            assert self.store.blocks_of(seq_id) == entry.host_blocks, f"{seq_id!r}: host blocks disagree with the store"
            assert len(entry.host_blocks) <= entry.num_tokens // size, f"{seq_id!r}: saved more than its full blocks"
            assert entry.loads_issued is None or 0 <= entry.loads_issued < len(entry.host_blocks), \
                f"{seq_id!r}: loads issued past its checkpoint"
            if entry.resident:
                table = self.pool.block_table(seq_id)
                assert self.pool.has(seq_id), f"{seq_id!r} resident but has no device blocks"
                assert entry.num_tokens <= len(table) * size, f"{seq_id!r}: more computed tokens than slots"
                if self.is_restoring(seq_id):
                    assert entry.num_tokens == len(entry.host_blocks) * size, \
                        f"{seq_id!r} restoring past its checkpoint"
                    assert len(table) == self.pool.blocks_for(entry.num_tokens), f"{seq_id!r} grew while restoring"
            else:
                assert not self.pool.has(seq_id), f"{seq_id!r} preempted but still holds device blocks"
                assert entry.num_tokens == len(entry.host_blocks) * size
                assert entry.loads_issued is None, f"{seq_id!r} preempted yet restoring"
        if not self._tracked:
            assert self.store.num_free_blocks == self.store.num_blocks, "host blocks leaked"
        held = [b for ticket in self._holding for b in self._touching.get(ticket, ())]
        assert len(held) == len(set(held)) == self.pool.num_hold_marks, "held blocks disagree with in-flight copies"
        assert self._holding <= set(self._touching), "a block is held for a copy that landed"
        for seq_id, entry in self._tracked.items():
            assert entry.in_flight <= set(self._touching), f"{seq_id!r}: an in-flight copy is unknown"
            if entry.resident:
                own = set(self.pool.block_table(seq_id))
                for ticket in entry.in_flight:
                    if ticket not in self._holding:
                        assert set(self._touching[ticket]) <= own, f"{seq_id!r}: a copy touches a block not its own"
