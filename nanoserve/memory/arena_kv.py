"""KunServe's arena (memory/arena.py) behind the `KVManager` interface (§3, §4.1, §4.4).

Between drops and restores the arena is a plain paged allocator, so `PagedKV` does the
per-request work unchanged: blocks on demand, recompute on preemption. What differs is that
capacity moves. A drop turns weight bytes into KV blocks, a restore takes them back, and
`num_blocks` reports the capacity at the current geometry; the scheduler sees the change
through `can_reserve` (the arena's exact free-block count) with no policy code of its own.

Drops and restores are started by the runner (`ModelRunner.drop_layers`), which must ship the
dropped layers' KV to the pipeline peer first (§4.2). The arena records every change in its
`history`; the counters here are read from it, so they cannot drift from what happened.

No prefix caching (an engine with the arena refuses `enable_prefix_caching=True`). A drop
re-carves the arena: logical blocks move to new pages, and every layer's K/V of the dropped
layers leaves for the pipeline peer (§4.2), so a block cached here would have to follow each
remap and each exchange to stay what its hash names, and a restore retires blocks under it.
What a block shared between a dropped member's requests means across a merge (which side's
copy the peer reads) is a question §4 never meets: KunServe's vLLM baseline ran without
prefix caching. Left for later; the paged pool underneath shares nothing.

Not in the registry of nanoserve/memory/__init__.py: the arena holds the model's weights, so
`build_engine` builds it with the model (the `kv_manager == "arena"` branch).
"""
from __future__ import annotations

from nanoserve.memory.arena import MemoryArena
from nanoserve.memory.manager import KVManager, PagedKV


class ArenaKV(PagedKV):
    """`PagedKV` over a `MemoryArena`; capacity follows the arena's drops and restores."""

    # The arena has no one-pass `try_allocate`: check, then reserve.
    try_reserve = KVManager.try_reserve

    def __init__(self, arena: MemoryArena):
        # The arena is BlockPool-compatible (allocate, free, block_table, ...), less try_allocate,
        # which try_reserve above does without; no protocol names that subset.
        super().__init__(arena)  # type: ignore[arg-type]
        self.arena = arena

    @property
    def num_blocks(self) -> int:
        """Blocks the non-weight bytes hold at the current geometry (grows with each drop)."""
        return self.arena.capacity_blocks

    @property
    def events(self) -> dict[str, int]:
        history = self.arena.history
        drops = [c for c in history if c.kind == "drop"]
        restores = [c for c in history if c.kind == "restore"]
        return {
            "layer_drops": len(drops),
            "layer_restores": len(restores),
            "layers_dropped_now": len(self.arena.layer_ids) - len(self.arena.resident_layers),
            "kv_tokens_gained": sum(c.capacity_after - c.capacity_before for c in drops),
            "kv_tokens_returned": sum(c.capacity_before - c.capacity_after for c in restores),
        }

    def check_invariants(self) -> None:
        # Re-reading every weight byte each engine step would cost a full pass over the model;
        # the per-step check keeps the cheap structural invariants (tests check the bytes too).
        self.arena.check_invariants(check_weight_bytes=False)
