"""BROS's bidirectional KV blocks behind the `KVManager` interface (bros.txt §5).

Online requests are BROS's real-time (RT) sequences, offline ones its best-effort (BE)
sequences, which fill each block from its last slot (`right_to_left`). The scheduler's calls map
onto `BidirectionalBlockManager`:

    order(running)        RT first, then BE, stable otherwise (BROS serves RT before BE, §4)
    can_reserve(r, n)     exact and side-effect free: `can_grow`
    reserve(r, n)         `grow`: restore r's checkpointed or swapped-out positions (§5.2
                          ensure_resident), then allocate; an RT page may overwrite BE slots,
                          saving them to the host first (lazy checkpointing, §5.2)
    preempt(r)            the last resort of §5.2: swap r out to the host (it keeps its computed
                          tokens) or, when the host is full, forget it (recompute from zero)
    release(r)            free r's device blocks and host copies

Why one step's copy groups are safe (see nanoserve/sched/base.py): the forward pass reads and
writes the slots of every request given a chunk this step, so none of them may be overwritten,
taken or moved later in the step. `order` serves RT first, so RT overwrites of BE slots happen
before any BE request is given its chunk, and each BE request restores its lost positions in
its own `reserve`. A request admitted from the queue comes after the running BE requests, so
every request granted a chunk is `pinned` until the next step: an RT page never overwrites a
pinned sequence (it takes another block, or waits). BE growth never touches another sequence's
slots, and the scheduler never preempts a request it gave a chunk this step.

FCFS preempts from the end of `order`'s list, so BE requests are dropped before RT ones, the
newest (least urgent) first; the manager's own victim choice (`allocate(victims=...)`) is not
used here, since the scheduler picks victims.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from nanoserve.memory import KVBuildContext, refuse_prefix_caching
from nanoserve.memory.bidirectional import BidirectionalBlockManager
from nanoserve.memory.host import HostKVStore, KVCopy
from nanoserve.memory.manager import KVManager
from nanoserve.slo import RequestClass

if TYPE_CHECKING:
    from nanoserve.request import Request


class BidirectionalKV(KVManager):
    """Shared RT/BE blocks with lazy checkpointing of overwritten BE slots (BROS §5)."""

    def __init__(self, blocks: BidirectionalBlockManager):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.host_store = blocks.host
        self.num_preempted = 0  # scheduler preemptions: swap-outs plus recomputes

    # -- capacity --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.blocks.num_blocks - self.blocks.num_free_blocks

    # -- the step --------------------------------------------------------------------------
    # The per-chunk calls below test `priority` inline: BROS makes them for every request it
    # schedules, a thousand a step.
    def right_to_left(self, request: Request) -> bool:
        return request.priority is RequestClass.OFFLINE

    def order(self, running: list[Request]) -> list[Request]:
        # Stable: RT, then BE, each in FCFS order (two filters beat a keyed sort).
        rt = [r for r in running if r.priority is not RequestClass.OFFLINE]
        return rt if len(rt) == len(running) else rt + [r for r in running if r.priority is RequestClass.OFFLINE]

    def step_copies(self, running: list[Request], window: float | None = None) -> list[KVCopy]:
        # A new step: last step's forward is done, so no sequence's slots are in use any more.
        self.blocks.pinned.clear()
        return []

    def can_reserve(self, request: Request, num_tokens: int) -> bool:
        return self.blocks.can_grow(request.request_id, num_tokens,
                                    best_effort=request.priority is RequestClass.OFFLINE)

    def reserve(self, request: Request, num_tokens: int) -> list[KVCopy]:
        copies = self.blocks.grow(request.request_id, num_tokens,
                                  best_effort=request.priority is RequestClass.OFFLINE)
        self.blocks.pinned.add(request.request_id)  # its chunk's forward reads these slots
        return copies

    def try_reserve(self, request: Request, num_tokens: int) -> list[KVCopy] | None:
        copies = self.blocks.try_grow(request.request_id, num_tokens,
                                      best_effort=request.priority is RequestClass.OFFLINE)
        if copies is not None:
            self.blocks.pinned.add(request.request_id)
        return copies

    def block_table(self, request: Request) -> list[int]:
        return self.blocks.block_table(request.request_id)

    def fits_after_preempting(self, request: Request, num_tokens: int, victims: Iterable[Request]) -> bool:
        """For an RT request: whether enough blocks could take its pages (FindPreemptBlock's
        targets, free or BE-only: their BE slots are checkpointed, or their owners dropped, as
        the last resort of §5.2); evicting BE requests adds none, since an RT page never shares a
        block with another RT page. BE requests: the default."""
        if request.priority is RequestClass.OFFLINE:
            return super().fits_after_preempting(request, num_tokens, victims)
        # The count first: a scheduler asks this after `can_reserve` said no (BROS does), so the
        # exact test, a search, runs only where the count cannot settle it.
        return (self.blocks.rt_pages_lacking(request.request_id, num_tokens) <= self.blocks.rt_page_room()
                or self.can_reserve(request, num_tokens))

    def preempt(self, request: Request) -> tuple[int, list[KVCopy]]:
        seq = request.request_id
        if not self.blocks.has(seq):
            return 0, []
        self.num_preempted += 1
        result = self.blocks.drop(seq)
        if result.recompute:
            return 0, []
        # The manager holds exactly the computed positions (a victim was never reserved this
        # step), and all of them are now on the host: the request resumes after them.
        return min(request.num_computed_tokens, self.blocks.num_tokens(seq)), list(result.copies)

    def release(self, request: Request) -> None:
        self.blocks.free(request.request_id)

    # -- what BROS's scheduler reads (the KVManager capabilities it asks of every manager) ----
    def host_slots(self, request: Request) -> int:
        seq = request.request_id
        return len(self.blocks.missing_positions(seq)) if self.blocks.has(seq) else 0

    def host_positions(self) -> dict[str, int]:
        return cast("dict[str, int]", self.blocks.host_positions())  # its sequences are request ids

    def host_slots_version(self) -> int:
        # Only RT growth's checkpoints change a request's host slots behind the scheduler's back.
        return self.blocks.checkpointed_slots

    def can_place_rt_page(self) -> bool:
        return self.blocks.can_place_rt_page()

    # -- observability ----------------------------------------------------------------------
    @property
    def events(self) -> dict[str, int]:
        b = self.blocks
        return {
            "block_preemptions": b.preemptions,  # RT pages placed on a block with a live BE page
            "overwrites": b.overwrites,  # BE pages that lost slots to an RT page
            "checkpointed_slots": b.checkpointed_slots,
            "restored_pages": b.restored_pages,
            "relocated_pages": b.relocated_pages,
            "swap_outs": b.swap_outs,
            "recomputes": b.recomputes,
            "preemptions": self.num_preempted,
        }

    def check_invariants(self) -> None:
        self.blocks.check_invariants()


def build(ctx: KVBuildContext) -> BidirectionalKV:
    """The registry's builder for "bidirectional" (see nanoserve/memory/__init__.py). No options."""
    refuse_prefix_caching(ctx, "bidirectional", "a best-effort request fills each block from its last slot, and a "
                          "real-time page may overwrite a best-effort block after a lazy save (BROS §4.1), so a "
                          "cached block could change under a request that shares it")
    if ctx.host_store is None:
        raise ValueError("the bidirectional KV manager needs a host KV store")
    if ctx.options:
        raise ValueError(f"the bidirectional KV manager takes no options, got {sorted(ctx.options)}")
    store: HostKVStore = ctx.host_store
    return BidirectionalKV(BidirectionalBlockManager(ctx.num_blocks, ctx.block_size, store))
