"""vLLM's swap preemption (Kwon et al., SOSP'23, §4.5 "Swapping"), the baseline the papers ran.

vLLM 0.2-0.5, the version EcoServe ("vLLM with the KVC swapping strategy", ecoserve.txt §2.1),
BROS and ConServe (vLLM 0.4.2, conserve.txt §5) compared against, preempts a running sequence by
copying all its blocks to host memory, and brings it back whole before it runs again:

    preempt(r)   all of r's blocks ──save──► host blocks; the device blocks are free at once
    reserve(r)   (r swapped out) fresh device blocks ◄──load── host blocks, then grow as usual

"Swapping out ... all blocks of the sequence are transferred to the CPU ... until it is swapped
back in" (vLLM §4.5). Both copies block the step that issues them, as vLLM's worker waited for
its cache operations before running the model: the save's freed blocks may be handed to another
request in that very step, and the load's request reads its K/V in it. So a swap never overlaps
a forward, which is the cost ConServe's checkpoints (memory/checkpoint.py) and BROS's lazy
saves set out to avoid. A swapped-out request resumes only after its save has landed (vLLM never
swaps a sequence in at the step it swapped it out); its host blocks are freed once its load has
landed. Assumption: the whole forward waits for a swap, as vLLM 0.4's worker swapped before
running the model; vLLM 0.2 waited layer by layer (one cache event per layer), which would hide
part of a swap under the forward's first layers. Not swept.

Ours, not vLLM's: when the host has no room for a victim, vLLM aborts the request ("Aborted due
to the lack of CPU swap space"); here it is preempted by recompute instead (`events` counts these
as `swap_fallbacks`), so a small `host_kv_tokens` degrades to vLLM's recompute.

Option `swap_budget_blocks` (InferCept's per-iteration swap budget, for KunServe's paper-era
InferCept row): a step swaps out at most this many blocks; a victim past the budget is
preempted by recompute instead (`swap_budget_fallbacks`). InferCept (Abhyankar et al., ICML'24)
bounds each iteration's swapping to what its forward hides, and discards the rest. None (the
default): no budget, as vLLM swaps.

Everything else is `PagedKV` over a `BlockPool`: on-demand blocks, nothing copied while a request
runs. Copies are whole blocks, the partly filled last one included, as vLLM swaps blocks.

With prefix caching (the pool's, as `PagedKV` drives it): a swap-out copies every block of the
request's table, shared ones included, and drops its references (a shared block stays on the
device for its other owners; a committed one it held alone waits, cached, in the LRU). A swap-in
loads into fresh blocks, never into shared ones; they are committed again after its next step,
and where that content is cached in another block already, that block stays the shared copy. A
request preempted by recompute (no room on the host) finds its committed blocks in the cache
again if nothing evicted them meanwhile.

Invariants (checked by `check_invariants`):
  1. The pool and the host store keep their own (conservation, no block in two places).
  2. A swapped-out request holds no device block and exactly ceil(kept / B) host blocks.
  3. The host store's owners are the swapped-out requests and the swapped-in ones whose load
     has not landed yet, each holding exactly the host blocks recorded for it.
  4. The pool's held blocks are exactly those written by in-flight loads of released requests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.memory import KVBuildContext
from nanoserve.memory.blocks import BlockPool, NoFreeBlocksError
from nanoserve.memory.copies import device_slots
from nanoserve.memory.host import HostKVStore, KVCopy
from nanoserve.memory.manager import KVManager, PagedKV

if TYPE_CHECKING:
    from nanoserve.request import Request


@dataclass
class _Swapped:
    tokens: int  # leading tokens whose K/V the host copy holds
    host_blocks: list[int]
    saved: bool = False  # the save landed: the host copy may be read


@dataclass
class _Loading:
    """A swap-in not yet seen to land."""

    rid: str
    host_blocks: list[int]  # freed when the load lands
    device_blocks: list[int]  # held if the request gives its blocks up before then
    given_up: bool = False


class SwapKV(PagedKV):
    """Paged KV whose preemption swaps a request's blocks to host memory (vLLM's swap mode)."""

    host_store: HostKVStore  # always set: a swap manager cannot do without one

    def __init__(self, pool: BlockPool, store: HostKVStore, swap_budget_blocks: int | None = None):
        if pool.block_size != store.block_size:
            raise ValueError("device and host blocks must hold the same number of slots")
        super().__init__(pool)
        self.host_store = store
        self._swapped: dict[str, _Swapped] = {}
        self._loads: dict[int, _Loading] = {}  # ticket -> swap-in not yet seen to land
        self._loading: dict[str, int] = {}  # request -> its swap-in's ticket, while it holds the blocks
        self.swap_outs = self.swap_ins = self.blocks_swapped_out = self.blocks_swapped_in = 0
        self.swap_fallbacks = 0
        if swap_budget_blocks is not None and swap_budget_blocks < 0:
            raise ValueError(f"swap_budget_blocks must be >= 0, not {swap_budget_blocks}")
        self.swap_budget_blocks = swap_budget_blocks
        self._swapped_this_step = 0  # blocks swapped out since the step began (`step_copies`)
        self.swap_budget_fallbacks = 0

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self._swapped

    # -- preemption: swap out ------------------------------------------------------------------
    def preempt(self, request: Request) -> tuple[int, list[KVCopy]]:
        """Copy the request's blocks to the host and free them; returns (its computed tokens, the
        save). With no room on the host, recompute (ours: vLLM would abort the request)."""
        rid = request.request_id
        tokens = request.num_computed_tokens
        table = self.pool.block_table(rid)
        count = self.pool.blocks_for(tokens)
        if tokens == 0 or count > self.host_store.num_free_blocks:
            self.swap_fallbacks += tokens > 0
            self.release(request)
            return 0, []
        if self.swap_budget_blocks is not None and self._swapped_this_step + count > self.swap_budget_blocks:
            self.swap_budget_fallbacks += 1  # past the step's budget: discarded, recomputed later
            self.release(request)
            return 0, []
        self._swapped_this_step += count
        host_blocks = self.host_store.allocate(rid, count)
        save = KVCopy("save", device_slots(table[:count], self.block_size), self.host_store.slots_of(host_blocks),
                      blocking=True)
        self._give_up_device(rid)  # blocking: this step's forward and later copies come after it
        entry = self._swapped[rid] = _Swapped(tokens, host_blocks)
        self.host_store.inflight.when_landed(save, lambda: setattr(entry, "saved", True))
        self.swap_outs += 1
        self.blocks_swapped_out += count
        return tokens, [save]

    def step_copies(self, running: list[Request], window: float | None = None) -> list[KVCopy]:
        self._swapped_this_step = 0  # a new step: its swap budget is whole again
        return super().step_copies(running, window)

    # -- resume: swap in, then grow ----------------------------------------------------------------
    def can_reserve(self, request: Request, num_tokens: int) -> bool:
        entry = self._swapped.get(request.request_id)
        if entry is None:
            return super().can_reserve(request, num_tokens)
        return entry.saved and self.pool.can_allocate(request.request_id, max(num_tokens, entry.tokens))

    def reserve(self, request: Request, num_tokens: int) -> list[KVCopy]:
        rid = request.request_id
        entry = self._swapped.get(rid)
        if entry is None:
            return super().reserve(request, num_tokens)
        if not self.can_reserve(request, num_tokens):
            raise NoFreeBlocksError(f"{rid}: cannot swap in {entry.tokens} tokens and grow to {num_tokens}"
                                    f" ({self.pool.num_free_blocks} free blocks; saved: {entry.saved})")
        del self._swapped[rid]
        self.pool.allocate(rid, max(num_tokens, entry.tokens))
        device_blocks = self.pool.block_table(rid)[:len(entry.host_blocks)]
        load = KVCopy("load", self.host_store.slots_of(entry.host_blocks), device_slots(device_blocks, self.block_size),
                      reader=rid, blocking=True)
        self._loads[load.ticket] = _Loading(rid, entry.host_blocks, list(device_blocks))
        self._loading[rid] = load.ticket
        self.host_store.inflight.when_landed(load, lambda: self._load_landed(load.ticket))
        self.swap_ins += 1
        self.blocks_swapped_in += len(device_blocks)
        return [load]

    def try_reserve(self, request: Request, num_tokens: int) -> list[KVCopy] | None:
        if request.request_id not in self._swapped:
            return super().try_reserve(request, num_tokens)
        return KVManager.try_reserve(self, request, num_tokens)  # check, then swap in and grow

    def _load_landed(self, ticket: int) -> None:
        loading = self._loads.pop(ticket)
        self.host_store.free(loading.rid, loading.host_blocks)
        if loading.given_up:
            self.pool.unhold(loading.device_blocks)
        else:
            del self._loading[loading.rid]

    # -- finishing -----------------------------------------------------------------------------
    def release(self, request: Request) -> None:
        rid = request.request_id
        entry = self._swapped.pop(rid, None)
        if entry is not None:
            # Copies land in issue order, so a later save into these host blocks lands after
            # this one's: they may be handed out at once.
            self.host_store.free(rid, entry.host_blocks)
        self._give_up_device(rid)

    def _give_up_device(self, rid: str) -> None:
        ticket = self._loading.pop(rid, None)
        if ticket is None:
            self.pool.free(rid)
            return
        # Its swap-in has not been seen to land: the blocks it writes stay out of reach till then.
        loading = self._loads[ticket]
        loading.given_up = True
        self.pool.free(rid, hold=loading.device_blocks)

    # -- observability -------------------------------------------------------------------------
    @property
    def events(self) -> dict[str, int]:
        return {**super().events,  # the prefix cache's
                "swap_outs": self.swap_outs, "swap_ins": self.swap_ins, "blocks_swapped_out": self.blocks_swapped_out,
                "blocks_swapped_in": self.blocks_swapped_in, "swap_fallbacks": self.swap_fallbacks,
                "swap_budget_fallbacks": self.swap_budget_fallbacks}

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.host_store.check_invariants()
        expected: dict[str, list[int]] = {}
        for rid, entry in self._swapped.items():
            assert not self.pool.has(rid), f"{rid}: swapped out but holds device blocks"
            assert len(entry.host_blocks) == self.pool.blocks_for(entry.tokens), f"{rid}: host copy of the wrong size"
            expected.setdefault(rid, []).extend(entry.host_blocks)
        held = 0
        for ticket, loading in self._loads.items():
            expected.setdefault(loading.rid, []).extend(loading.host_blocks)
            if loading.given_up:
                held += len(loading.device_blocks)
            else:
                assert self._loading.get(loading.rid) == ticket, f"{loading.rid}: a live swap-in is not filed"
                table = self.pool.block_table(loading.rid)
                assert table[:len(loading.device_blocks)] == loading.device_blocks, \
                    f"{loading.rid}: swap-in blocks moved"
        assert all(self._loads[t].rid == rid for rid, t in self._loading.items())
        assert held == self.pool.num_hold_marks, "held blocks disagree with the swap-ins in flight"
        owned = self.host_store.num_blocks - self.host_store.num_free_blocks
        assert owned == sum(map(len, expected.values())), "host blocks held by someone the swap manager does not track"
        for rid, blocks in expected.items():
            assert sorted(self.host_store.blocks_of(rid)) == sorted(blocks), \
                f"{rid}: host blocks disagree with the store"


def build(ctx: KVBuildContext) -> SwapKV:
    """The registry's builder for "swap" (see nanoserve/memory/__init__.py). Option:
    `swap_budget_blocks` (module docstring)."""
    if ctx.host_store is None:
        raise ValueError("the swap KV manager needs a host KV store")
    unknown = set(ctx.options) - {"swap_budget_blocks"}
    if unknown:
        raise ValueError(f"the swap KV manager takes only the option swap_budget_blocks, got {sorted(unknown)}")
    return SwapKV(BlockPool(ctx.num_blocks, ctx.block_size, enable_prefix_caching=ctx.prefix_caching), ctx.host_store,
                  ctx.options.get("swap_budget_blocks"))
