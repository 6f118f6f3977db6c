"""ConServe's incremental checkpointing behind the `KVManager` interface (conserve.txt §4.4).

The scheduler keeps thinking in requests and token counts; this adapter maps its calls onto a
`BlockPool` (device blocks, vLLM-style) and an `IncrementalCheckpointer` (host copies):

    step_copies(running)   plan_step: save the newly completed blocks of some running requests
                           once device usage passes the threshold, offline requests first
    preempt(request)       free the device blocks at once, no copy; the request keeps the
                           checkpointed prefix and recomputes only the unsaved tail
    reserve(request, n)    a preempted request with a checkpoint is prefetched first (its loads
                           are returned), then grown to n like any other
    release(request)       free device blocks and host copy

Why this is safe beside the forward (memory/copies.py): checkpoint saves run on the copy stream
under later forwards, and nobody waits for them; a block an in-flight save still reads is held,
not freed, when its request is preempted or finishes, until the scheduler's poll reports the save
landed. A preempted request whose checkpoint is still being written cannot be resumed
(`can_reserve` is False) until it lands. Loads come from `reserve`, i.e. only for a request that is
being given a chunk, and name it as their reader: that step's forward waits for them.

Unlike the paper, a prefetch's loads are issued in the step that resumes the request, not a step
ahead, so that step waits for them (the ConServe issue moves them into the background). The
scheduler decides when to resume; this adapter only restores.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from nanoserve.memory.blocks import BlockPool, NoFreeBlocksError
from nanoserve.memory.checkpoint import CheckpointConfig, IncrementalCheckpointer
from nanoserve.memory.host import HostKVStore, KVCopy
from nanoserve.memory.manager import KVManager, PagedKV

if TYPE_CHECKING:
    from nanoserve.request import Request

OPTIONS = frozenset({"threshold", "max_blocks_per_step"})


class CheckpointKV(PagedKV):
    """Paged device KV whose preemptions resume from incremental host checkpoints (ConServe §4.4).

    A resident request is plain `PagedKV` growth; only a preempted one (holding a checkpoint and
    no device blocks) needs the prefetch below."""

    def __init__(self, pool: BlockPool, store: HostKVStore, config: CheckpointConfig = CheckpointConfig()):
        super().__init__(pool)
        self.host_store = store
        self.checkpointer = IncrementalCheckpointer(pool, store, config)
        self.tokens_saved_from_recompute = 0  # restored by prefetch instead of recomputed

    # -- the step ---------------------------------------------------------------------------
    def step_copies(self, running: list[Request]) -> list[KVCopy]:
        """Checkpoint the running requests' newly completed blocks (§4.4, adaptive rate).

        Offline requests are ranked first: they are the ones ConServe preempts for online
        bursts, so their checkpoints are what make preemption cheap. Within the offline ones,
        those already checkpointed come first (their set stays stable, so each stays cheap to
        preempt), then the ones with most unsaved blocks; online requests follow, ordered by the
        checkpointer's own tie-breaks.
        """
        ckpt, size = self.checkpointer, self.block_size
        computed = {r.request_id: r.num_computed_tokens for r in running}
        offline = [r.request_id for r in running if r.priority == "offline"]
        offline.sort(key=lambda rid: (ckpt.saved_blocks(rid) == 0, -(computed[rid] // size - ckpt.saved_blocks(rid))))
        return ckpt.plan_step(computed, order=offline)

    def can_reserve(self, request: Request, num_tokens: int) -> bool:
        # A preempted request holds no device blocks, so blocks_for(num_tokens) covers both its
        # prefetched prefix and its growth; max() guards a caller asking for less than it kept.
        rid = request.request_id
        if self.checkpointer.is_preempted(rid) and not self.checkpointer.can_resume(rid):
            return False  # its checkpoint is still being written
        return self.pool.can_allocate(rid, self._target(request, num_tokens))

    def reserve(self, request: Request, num_tokens: int) -> list[KVCopy]:
        rid = request.request_id
        if not self.checkpointer.is_preempted(rid):  # most calls: plain paged growth
            return super().reserve(request, num_tokens)
        target = self._target(request, num_tokens)
        if not self.can_reserve(request, num_tokens):  # all or nothing: check before prefetching
            raise NoFreeBlocksError(f"{rid}: cannot hold {target} tokens with {self.pool.num_free_blocks} free blocks"
                                    f" (or its checkpoint is still in flight)")
        copies = self.checkpointer.prefetch(rid)
        self.tokens_saved_from_recompute += self.checkpointer.saved_tokens(rid)
        self.pool.allocate(rid, target)
        return copies

    def try_reserve(self, request: Request, num_tokens: int) -> list[KVCopy] | None:
        if not self.checkpointer.is_preempted(request.request_id):
            return super().try_reserve(request, num_tokens)
        return KVManager.try_reserve(self, request, num_tokens)  # check, then prefetch and grow

    def _target(self, request: Request, num_tokens: int) -> int:
        if self.pool.has(request.request_id):  # resident, so not preempted: nothing to restore
            return num_tokens
        return max(num_tokens, self.checkpointer.saved_tokens(request.request_id)
                   if self.checkpointer.is_preempted(request.request_id) else 0)

    def preempt(self, request: Request) -> tuple[int, list[KVCopy]]:
        # No copies: the saves happened in earlier steps (or in this step's first group, which
        # runs before anything can reuse the freed blocks).
        return self.checkpointer.preempt(request.request_id), []

    def release(self, request: Request) -> None:
        self.checkpointer.release(request.request_id)

    # -- observability ----------------------------------------------------------------------
    @property
    def events(self) -> dict[str, int]:
        ckpt = self.checkpointer
        return {
            "blocks_checkpointed": ckpt.blocks_checkpointed,
            "preemptions_with_checkpoint": ckpt.preemptions_with_checkpoint,
            "prefetches": ckpt.prefetches,
            "blocks_prefetched": ckpt.blocks_prefetched,
            "tokens_saved_from_recompute": self.tokens_saved_from_recompute,
        }

    def check_invariants(self) -> None:
        self.checkpointer.check_invariants()


def build(ctx) -> CheckpointKV:
    """The registry's builder for "checkpoint" (see nanoserve/memory/__init__.py).

    Options: `threshold` (device usage at which checkpointing starts, default 0.5 as in the
    paper) and `max_blocks_per_step` (per-step copy budget in blocks).
    """
    if ctx.host_store is None:
        raise ValueError("the checkpoint KV manager needs a host KV store")
    unknown = set(ctx.options) - OPTIONS
    if unknown:
        raise ValueError(f"unknown checkpoint option(s) {sorted(unknown)}; known: {sorted(OPTIONS)}")
    return CheckpointKV(BlockPool(ctx.num_blocks, ctx.block_size), ctx.host_store, CheckpointConfig(**ctx.options))
