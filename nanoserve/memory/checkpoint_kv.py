"""ConServe's incremental checkpointing behind the `KVManager` interface (conserve.txt §4.4).

The scheduler keeps thinking in requests and token counts; this adapter maps its calls onto a
`BlockPool` (device blocks, vLLM-style) and an `IncrementalCheckpointer` (host copies). A request
is in one of these states (the scheduler's queue in brackets):

    running      [running]  resident; its new full blocks are checkpointed (step_copies)
    paused       [waiting]  over budget, K/V still on the device (pause); reserve resumes it free
    preempted    [waiting]  device blocks dropped (preempt); its checkpointed prefix is on host
    prefetching  [waiting]  device blocks back, loads issued step by step ahead (prefetch)

    running ──pause──► paused ──reserve──► running        (no copy at all)
       │                  │ preempt: a request needs the memory
       └─────preempt──────┴──► preempted ──prefetch──► prefetching ──reserve──► running
                                   ▲  reserve (loads it all, that step waits) │
                                   └──────────────────preempt─────────────────┘

- `step_copies(running, window)` (plan_step): save the newly completed blocks of some running
  and paused requests once device usage passes the threshold: paused requests first (they are
  the next to be dropped), then offline ones; within the step's link budget (`window` seconds
  over the profiled per-block link time, `block_seconds`). Whatever the saves leave of that
  budget goes to `prefetch`.
- `pause(request)`: §4.4, "checkpointing keeps KV caches in GPU memory until incoming online
  requests are scheduled". Nothing moves or is freed; the blocks stay the request's.
- `preempt(request)`: "Discarding KV caches in ConServe is as fast and lightweight as freeing
  victim KV cache blocks": free the device blocks, no copy; the request keeps the checkpointed
  prefix and recomputes only the unsaved tail. On a paused request this is the discard.
- `prefetch(request)`: §4.4's background prefetching. The first call allocates device blocks for
  the checkpoint (all or nothing); each call issues loads of as many blocks as the step's link
  budget has left ("split the swap-in phase over multiple steps").
- `reserve(request, n)`: a paused request just grows; a prefetching or preempted one first gets
  the loads still missing (the step that runs it waits for those: `restore_seconds` prices them).
- `release(request)`: free device blocks and host copy.

Why this is safe beside the forward (memory/copies.py): checkpoint saves run on the copy stream
under later forwards, and nobody waits for them; a block an in-flight save still reads is held,
not freed, when its request is preempted or finishes, until the scheduler's poll reports the save
landed. A preempted request whose checkpoint is still being written cannot be resumed
(`can_reserve` is False) until it lands. Loads name their request as reader: only a forward that
runs it waits for them, whenever they were issued.

The scheduler decides whom to pause, drop, prefetch and resume; this adapter only keeps K/V.

Prefix caching (the pool's, as `PagedKV` drives it; §4.4 says nothing of it, so these are ours):
- A request's table may begin with blocks it shares with others. Its checkpoint still saves
  every block of its table, shared ones included: each request owns its host copy, so a
  preempted request resumes from it whatever became of the shared blocks.
- Preempting drops the request's references. A shared block stays on the device for its other
  owners; one a save in flight still reads is marked until the save lands (the pool's hold
  marks), so if its last owner frees it meanwhile it is held, not reused.
- A prefetch or resume loads into fresh blocks, never shared ones; they are committed again
  after the step that runs the request. A request preempted with nothing saved waits with
  nothing computed, and finds its committed blocks in the cache if nothing evicted them.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from nanoserve.memory import KVBuildContext
from nanoserve.memory.blocks import BlockPool, NoFreeBlocksError
from nanoserve.memory.checkpoint import CheckpointConfig, IncrementalCheckpointer
from nanoserve.memory.host import HostKVStore, KVCopy
from nanoserve.memory.manager import KVManager, PagedKV
from nanoserve.slo import RequestClass

if TYPE_CHECKING:
    from nanoserve.request import Request

OPTIONS = frozenset({"threshold", "max_blocks_per_step"})


class CheckpointKV(PagedKV):
    """Paged device KV whose preemptions resume from incremental host checkpoints (ConServe §4.4)."""

    def __init__(self, pool: BlockPool, store: HostKVStore, config: CheckpointConfig = CheckpointConfig(),
                 block_seconds: float | None = None):
        super().__init__(pool)
        self.host_store = store
        self.checkpointer = IncrementalCheckpointer(pool, store, config)
        # Link time of one block's copy, as ConServe's profiler measures "the swap latency with
        # respect to the number of KV cache blocks" (§4.5); None: unknown, so no link budget.
        self.block_seconds = block_seconds
        self._paused: dict[str, Request] = {}  # waiting requests whose K/V stayed on the device
        self._prefetching: dict[str, Request] = {}  # waiting requests being brought back ahead
        self._link_blocks: int | None = None  # this step's link budget left, in blocks (None: no limit)
        # Counters, so a caller (or test) can tell each mechanism ran.
        self.tokens_saved_from_recompute = 0  # restored from host instead of recomputed
        self.tokens_preempted = 0  # computed tokens whose device K/V a preemption dropped
        self.tokens_kept_on_host = 0  # of those, the ones a checkpoint kept
        self.pauses = self.pauses_resumed = self.paused_dropped = 0
        self.blocks_loaded_ahead = self.blocks_loaded_on_resume = 0

    # -- the step ---------------------------------------------------------------------------
    def step_copies(self, running: list[Request], window: float | None = None) -> list[KVCopy]:
        """Checkpoint the newly completed blocks of running and paused requests (§4.4, adaptive
        rate), within the step's link budget (§4.5).

        Paused requests are ranked first (an online request drops them before anyone else, and
        "no copy is needed if their checkpoint is current"), then offline ones: they are the ones
        ConServe preempts for online bursts. Within each, those already checkpointed come first
        (their set stays stable, so each stays cheap to preempt), then the ones with most unsaved
        blocks; online requests follow, ordered by the checkpointer's own tie-breaks.
        """
        self._link_blocks = None if window is None or not self.block_seconds else int(window / self.block_seconds)
        ckpt, size = self.checkpointer, self.block_size
        computed: dict[Hashable, int] = {r.request_id: r.num_computed_tokens
                                         for r in (*self._paused.values(), *running)}

        def rank(rid: str) -> tuple[bool, int]:
            return ckpt.saved_blocks(rid) == 0, -(computed[rid] // size - ckpt.saved_blocks(rid))

        paused = sorted(self._paused, key=rank)
        offline = sorted((r.request_id for r in running if r.priority is RequestClass.OFFLINE), key=rank)
        copies = ckpt.plan_step(computed, order=paused + offline, max_blocks=self._link_blocks)
        self._spend(copies)
        return copies

    def _spend(self, copies: list[KVCopy]) -> int:
        """Take `copies` off this step's link budget; returns their blocks."""
        blocks = sum(len(c.src) for c in copies) // self.block_size
        if self._link_blocks is not None:
            self._link_blocks = max(0, self._link_blocks - blocks)
        return blocks

    # -- pause, prefetch, resume ------------------------------------------------------------
    def pause(self, request: Request) -> tuple[int, list[KVCopy]] | None:
        """§4.4: "checkpointing keeps KV caches in GPU memory until incoming online requests
        are scheduled": nothing moves, nothing is freed."""
        if not self.pool.has(request.request_id):
            return self.preempt(request)
        self._paused[request.request_id] = request
        self.pauses += 1
        return None

    def prefetch(self, request: Request) -> list[KVCopy] | None:
        """§4.4: "instead of waiting for victim requests to be swapped in, ConServe worker
        launches a new offline batch and runs for its prefill phase, and meanwhile prefetches KV
        cache blocks in the background", splitting "the swap-in phase over multiple steps"
        within the link budget §4.5 sets ("defers the extra blocks to the next round")."""
        rid, ckpt = request.request_id, self.checkpointer
        if self._link_blocks == 0:
            return None
        if rid not in self._prefetching:
            if not (ckpt.is_preempted(rid) and ckpt.can_resume(rid)
                    and self.pool.can_allocate(rid, ckpt.saved_tokens(rid))):
                return None
            ckpt.start_prefetch(rid)
            self._prefetching[rid] = request
        copies = ckpt.load(rid, self._link_blocks)
        self.blocks_loaded_ahead += self._spend(copies)
        return copies

    def blocks_to_restore(self, request: Request) -> int:
        return self.checkpointer.unloaded_blocks(request.request_id)

    def restore_seconds(self, request: Request) -> float:
        return self.blocks_to_restore(request) * (self.block_seconds or 0.0)

    def preemption_loss(self, request: Request) -> int:
        rid = request.request_id
        if rid in self._prefetching or self.checkpointer.is_preempted(rid):
            return 0  # whatever it holds on the device is a copy of its checkpoint
        return max(0, request.num_computed_tokens - self.checkpointer.saved_tokens(rid))

    def can_reserve(self, request: Request, num_tokens: int) -> bool:
        # A preempted request holds no device blocks, so blocks_for(num_tokens) covers both its
        # prefetched prefix and its growth; max() guards a caller asking for less than it kept.
        rid = request.request_id
        if self.checkpointer.is_preempted(rid) and not self.checkpointer.can_resume(rid):
            return False  # its checkpoint is still being written
        return self.pool.can_allocate(rid, self._target(request, num_tokens))

    def reserve(self, request: Request, num_tokens: int) -> list[KVCopy]:
        rid, ckpt = request.request_id, self.checkpointer
        if rid in self._paused:  # its K/V never left: plain growth (raising, changing nothing, if no room)
            copies = super().reserve(request, num_tokens)
            del self._paused[rid]
            self.pauses_resumed += 1
            return copies
        if not (ckpt.is_preempted(rid) or rid in self._prefetching):
            return super().reserve(request, num_tokens)  # most calls: plain paged growth
        target = self._target(request, num_tokens)
        if not self.can_reserve(request, num_tokens):  # all or nothing: check before restoring
            raise NoFreeBlocksError(f"{rid}: cannot hold {target} tokens with {self.pool.num_free_blocks} free blocks"
                                    f" (or its checkpoint is still in flight)")
        if ckpt.is_preempted(rid):
            ckpt.start_prefetch(rid)
        copies = ckpt.load(rid)  # what is still missing: this step waits for it
        self.blocks_loaded_on_resume += sum(len(c.src) for c in copies) // self.block_size
        self._prefetching.pop(rid, None)
        self.tokens_saved_from_recompute += ckpt.saved_tokens(rid)
        self.pool.allocate(rid, target)
        return copies

    def try_reserve(self, request: Request, num_tokens: int) -> list[KVCopy] | None:
        rid = request.request_id
        if rid in self._paused or rid in self._prefetching or self.checkpointer.is_preempted(rid):
            return KVManager.try_reserve(self, request, num_tokens)  # check, then resume and grow
        return super().try_reserve(request, num_tokens)

    def _target(self, request: Request, num_tokens: int) -> int:
        if self.pool.has(request.request_id):  # resident (or prefetching): it holds its prefix
            return num_tokens
        return max(num_tokens, self.checkpointer.saved_tokens(request.request_id)
                   if self.checkpointer.is_preempted(request.request_id) else 0)

    def preempt(self, request: Request) -> tuple[int, list[KVCopy]]:
        """Drop the device blocks (a running request's, or a paused or prefetching one's), no
        copy: the saves happened in earlier steps (or in this step's first group, which runs
        before anything can reuse the freed blocks)."""
        rid = request.request_id
        if self._paused.pop(rid, None) is not None:
            self.paused_dropped += 1
        brought_back = self._prefetching.pop(rid, None) is not None
        kept = self.checkpointer.preempt(rid)
        if not brought_back:  # a prefetched one only gives back copies of its checkpoint
            self.tokens_preempted += request.num_computed_tokens
            self.tokens_kept_on_host += kept
        return kept, []

    def release(self, request: Request) -> None:
        self._paused.pop(request.request_id, None)
        self._prefetching.pop(request.request_id, None)
        self.checkpointer.release(request.request_id)

    # -- observability ----------------------------------------------------------------------
    @property
    def events(self) -> dict[str, int]:
        ckpt = self.checkpointer
        return {
            **super().events,  # the prefix cache's
            "blocks_checkpointed": ckpt.blocks_checkpointed,
            "preemptions_with_checkpoint": ckpt.preemptions_with_checkpoint,
            "prefetches": ckpt.prefetches,
            "blocks_prefetched": ckpt.blocks_prefetched,
            "blocks_loaded_ahead": self.blocks_loaded_ahead,
            "blocks_loaded_on_resume": self.blocks_loaded_on_resume,
            "tokens_saved_from_recompute": self.tokens_saved_from_recompute,
            "tokens_preempted": self.tokens_preempted,
            "tokens_kept_on_host": self.tokens_kept_on_host,
            "pauses": self.pauses,
            "pauses_resumed": self.pauses_resumed,
            "paused_dropped": self.paused_dropped,
        }

    def check_invariants(self) -> None:
        self.checkpointer.check_invariants()
        ckpt = self.checkpointer
        assert not (set(self._paused) & set(self._prefetching)), "a request both paused and prefetching"
        for rid in self._paused:
            assert self.pool.has(rid) and not ckpt.is_preempted(rid) and not ckpt.is_restoring(rid), \
                f"{rid!r} paused without its K/V on the device"
        for rid in self._prefetching:
            assert self.pool.has(rid) and not ckpt.is_preempted(rid), f"{rid!r} prefetching without device blocks"


def build(ctx: KVBuildContext) -> CheckpointKV:
    """The registry's builder for "checkpoint" (see nanoserve/memory/__init__.py).

    Options: `threshold` (device usage at which checkpointing starts, default 0.5 as in the
    paper) and `max_blocks_per_step` (an optional per-step cap on saves, in blocks). The link
    budget comes from the context's `block_seconds` (the profiled link time of one block).
    """
    if ctx.host_store is None:
        raise ValueError("the checkpoint KV manager needs a host KV store")
    unknown = set(ctx.options) - OPTIONS
    if unknown:
        raise ValueError(f"unknown checkpoint option(s) {sorted(unknown)}; known: {sorted(OPTIONS)}")
    return CheckpointKV(BlockPool(ctx.num_blocks, ctx.block_size, enable_prefix_caching=ctx.prefix_caching),
                        ctx.host_store, CheckpointConfig(**ctx.options), block_seconds=ctx.link_block_seconds)
