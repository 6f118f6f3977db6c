"""What a scheduler asks of KV memory, whichever paper's allocator sits underneath.

A scheduling policy thinks in requests and token counts: "can request r hold n tokens?",
"grow it to n", "preempt it", "it finished". Each allocator in this package answers in its own
terms (blocks, reservations, bidirectional pages, checkpoints). A `KVManager` translates, so any
policy runs over any allocator and the engine's step stays the same:

    policy (sched/*.py) ──► KVManager ──► BlockPool | MemoryArena | ExactAllocator |
                                          BidirectionalBlockManager | IncrementalCheckpointer

Data never moves here. Operations that need K/V moved (a checkpoint, a swap, a restore) return
`KVCopy` lists; the scheduler hands them to the executor in the step's `SchedulerOutput`, one
group per call, in call order. The executor issues them on one copy stream beside the forward
and waits only for what the forward reads (memory/copies.py). At the start of every step the
scheduler calls `poll_copies`: the manager learns which of its copies landed since, and only
then reuses what they touched (a block whose save was in flight, a host copy being written).

Preemption is not always recompute. `preempt` returns how many leading tokens keep valid K/V
off the device (on the host); the request resumes from there and the next `reserve` brings them
back. Zero means recompute everything, as vLLM does.

Automatic prefix caching (memory/prefix_cache.py) is a capability a manager declares
(`prefix_caching`): `cached_prefix` says how many leading tokens of a waiting request it holds
cached, `try_reserve_cached` starts the request's table with those blocks, and
`commit_computed` makes each block a step wrote shareable. The defaults share nothing.

`PagedKV` is the plain vLLM manager over a `BlockPool` (or any allocator with the same
interface, such as `MemoryArena`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.host import HostKVStore, KVCopy
from nanoserve.memory.prefix_cache import BlockHash, block_hashes
from nanoserve.memory.prefix_host_tier import PrefixHostTier, always_load
from nanoserve.request import Request, RequestStatus

if TYPE_CHECKING:  # nanoserve.memory imports this module
    from nanoserve.memory import KVBuildContext


def load_rule(link_block_seconds: float | None, recompute_seconds: Callable[[int, int], float] | None,
              block_size: int) -> Callable[[int, int], bool]:
    """The host tier's choice (memory/prefix_host_tier.py): load `blocks` after a prefix of
    `prefix_tokens` when their link time is at most recomputing their tokens; always load where
    either cost is unknown (the tier's assumption)."""
    if link_block_seconds is None or recompute_seconds is None:
        return always_load
    link, recompute = link_block_seconds, recompute_seconds
    return lambda blocks, prefix_tokens: blocks * link <= recompute(prefix_tokens, blocks * block_size)


class KVManager(ABC):
    block_size: int
    # Where this manager's copies go and whose ledger says when they landed; None: it makes none.
    host_store: HostKVStore | None = None

    # -- capacity, for stats and policies ------------------------------------------------
    @property
    @abstractmethod
    def num_blocks(self) -> int: ...

    @property
    @abstractmethod
    def num_used_blocks(self) -> int: ...

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request can ever hold; the engine caps max_model_len with it."""
        return self.num_blocks * self.block_size

    # -- what a policy calls --------------------------------------------------------------
    @abstractmethod
    def can_reserve(self, request: Request, num_tokens: int) -> bool:
        """Could `reserve(request, num_tokens)` succeed now? Changes nothing."""

    @abstractmethod
    def reserve(self, request: Request, num_tokens: int) -> list[KVCopy]:
        """Make `request` hold K/V slots for its first `num_tokens` positions (restoring what
        was moved off the device first). Raises NoFreeBlocksError, changing nothing, if it cannot."""

    def try_reserve(self, request: Request, num_tokens: int) -> list[KVCopy] | None:
        """`reserve` if it can succeed, else None, changing nothing. Schedulers call this once
        per request per step, so a manager may answer it in one pass."""
        return self.reserve(request, num_tokens) if self.can_reserve(request, num_tokens) else None

    @abstractmethod
    def block_table(self, request: Request) -> list[int]:
        """The request's block table as the runner reads it."""

    def right_to_left(self, request: Request) -> bool:
        """True when the request's positions fill each block from its last slot (BROS BE)."""
        return False

    @abstractmethod
    def release(self, request: Request) -> None:
        """The request finished or was aborted: free everything it holds, device and host."""

    def preempt(self, request: Request) -> tuple[int, list[KVCopy]]:
        """Take the request's K/V off the device. Returns (leading tokens whose K/V survive
        elsewhere, the copies that save them); the request resumes from that many tokens."""
        self.release(request)
        return 0, []

    def order(self, running: list[Request]) -> list[Request]:
        """The order in which this step serves running requests (FCFS by default). An allocator
        whose growth can take slots from another request may need the taker served first."""
        return running

    def poll_copies(self, wait: bool = False) -> tuple[int, ...]:
        """At the start of a step: learn which of this manager's copies landed since the last
        poll, running what their landing allows (`InflightCopies.when_landed`), and return
        their tickets, which every rank's executor then retires (`HostKVStore.retire`). With
        `wait` (the engine fell idle: nothing to overlap), first wait for the copy stream."""
        if self.host_store is None:
            return ()
        if wait:
            self.host_store.synchronize()
        return tuple(copy.ticket for copy in self.host_store.inflight.poll())

    def step_copies(self, running: list[Request], window: float | None = None) -> list[KVCopy]:
        """Copies to run at the start of a step, whatever is scheduled (ConServe's checkpoints).
        `window`: the seconds of link time the policy lets this step's background copies take
        (its SLO budget); None: no limit from the policy."""
        return []

    # -- what a manager may offer beyond preempt-and-recompute (the defaults offer nothing) --
    def pause(self, request: Request) -> tuple[int, list[KVCopy]] | None:
        """Stop running `request` for now but keep its K/V on the device, where the manager can,
        until the policy needs the memory and calls `preempt` on it (which then drops it); a
        later `reserve` resumes it with no copy. None: kept (nothing moved, nothing freed);
        else it preempted instead and returns what `preempt` does (the default)."""
        return self.preempt(request)

    def prefetch(self, request: Request) -> list[KVCopy] | None:
        """Start or go on bringing a preempted request's saved K/V back to the device ahead of
        the step that resumes it, within this step's link budget (`step_copies`' window); the
        loads name it as their reader. None: nothing to bring back, or no room or budget now."""
        return None

    def blocks_to_restore(self, request: Request) -> int:
        """Blocks of saved K/V that `reserve` would still have to load for `request` now."""
        return 0

    def restore_seconds(self, request: Request) -> float:
        """The link time of those loads, where the manager knows it (0: unknown or none)."""
        return 0.0

    def preemption_loss(self, request: Request) -> int:
        """Computed tokens of `request` that `preempt` would make it recompute."""
        return request.num_computed_tokens

    def fits_after_preempting(self, request: Request, num_tokens: int, victims: Iterable[Request]) -> bool:
        """Whether `request` could hold `num_tokens` positions if every one of `victims` (running
        requests with no chunk this step) were preempted first; changes nothing. An upper bound,
        for a policy that decides whom to pass over before it evicts anyone (BROS's Alg. 1).
        Default: the blocks it lacks against the free blocks plus every block the victims hold
        (a waiting request holds none on the device)."""
        held = len(self.block_table(request)) if request.status is RequestStatus.RUNNING else 0
        lacking = -(-num_tokens // self.block_size) - held
        room = self.num_blocks - self.num_used_blocks
        if lacking <= room:
            return True
        for victim in victims:
            room += len(self.block_table(victim))
            if lacking <= room:
                return True
        return False

    def admission_room_tokens(self) -> int:
        """Token slots a request admitted now could be given (EcoServe's A_KVC); default: every
        free block. A manager that holds some free blocks back for other uses says less."""
        return (self.num_blocks - self.num_used_blocks) * self.block_size

    def predicted_output_len(self, request: Request) -> int:
        """The response length the manager allocates `request` for (EcoServe's predicted RL);
        default: all that max_tokens allows, as a manager with no predictor must assume."""
        return request.output_tokens_left

    def predicted_total_output_len(self, request: Request) -> int:
        """The whole response the manager expects `request` to give, tokens already generated
        included (EcoServe's JCT deadline reads it); default: those plus `predicted_output_len`."""
        return request.num_output_tokens + self.predicted_output_len(request)

    @property
    def events(self) -> dict[str, int]:
        """Counters of the allocator's mechanisms (preemptions, checkpoints, ...)."""
        return {}

    # -- automatic prefix caching (memory/prefix_cache.py); the defaults: none ---------------
    @property
    def prefix_caching(self) -> bool:
        """Whether this manager shares cached prefix blocks between requests."""
        return False

    def cached_prefix(self, request: Request) -> int:
        """Leading tokens of the waiting `request`, which holds no K/V, whose K/V this manager
        has cached: a whole number of blocks, at most `num_tokens - 1` (the last token is always
        computed, so that there are logits to sample from). Changes nothing. The scheduler then
        sets the request's `num_computed_tokens` to it and calls `try_reserve_cached`."""
        return 0

    def try_reserve_cached(self, request: Request, num_tokens: int, cached: int) -> list[KVCopy] | None:
        """`try_reserve` for a waiting request that holds nothing and starts with `cached` tokens
        (what `cached_prefix` said) whose blocks it shares instead of computing; None, changing
        nothing, if it cannot (some of those blocks were evicted since, or no room). Default: a
        manager without a cache, whose `cached_prefix` is always 0."""
        if cached:
            raise ValueError(f"{type(self).__name__} keeps no prefix cache")
        return self.try_reserve(request, num_tokens)

    def can_reserve_cached(self, request: Request, num_tokens: int, cached: int) -> bool:
        """Could `try_reserve_cached(request, num_tokens, cached)` succeed now? Changes nothing."""
        if cached:
            raise ValueError(f"{type(self).__name__} keeps no prefix cache")
        return self.can_reserve(request, num_tokens)

    def commit_computed(self, request: Request) -> None:
        """A step wrote `request`'s K/V up to its `num_computed_tokens`: the full blocks among
        them may be shared from now on. Called for every chunk after every step."""

    def prefix_in_flight(self, request: Request) -> bool:
        """Whether the block right after the waiting `request`'s cached prefix is being computed
        now by another request (reserved for this step, committed after it): admitted one step
        later, `request` would find it cached. Default: never."""
        return False

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`); returns how many blocks were
        cached. Requests running keep their blocks."""
        return 0

    @abstractmethod
    def check_invariants(self) -> None: ...

    # -- what BROS's scheduler reads of host-resident K/V and RT placement ------------------
    # (sched/bros_queue.py, sched/bros.py). The defaults are what BROS assumes of a manager that
    # does not tell: nothing on the host, room for a page. BidirectionalKV overrides them.
    def host_slots(self, request: Request) -> int:
        """Positions of `request` whose K/V is on the host now, which its next `reserve` loads
        back; default 0. BROS files a waiting BE request under it (Alg. 1 line 17's swap-in cost)."""
        return 0

    def host_positions(self) -> dict[str, int]:
        """`host_slots` of every request that has any, by request id; default none. BROS sorts its
        running BE requests by it each step (line 17), so it must be cheap while none has any."""
        return {}

    def host_slots_version(self) -> int:
        """A counter that changes whenever a request's `host_slots` may change without a call on
        that request (a real-time page's growth saving a best-effort request's slots). BROS
        replays its draft's BE order only while it stays the same; default 0, never changing."""
        return 0

    def can_place_rt_page(self) -> bool:
        """Whether a new page of a real-time request could find room now (after whatever the
        manager may save or move for it). False: no RT request can gain a page this step, and
        BROS stops pulling waiting RT requests. Default: True, as a manager that cannot tell."""
        return True


class PagedKV(KVManager):
    """vLLM's paged KV: blocks on demand from a `BlockPool`-like allocator, recompute on
    preemption, and automatic prefix caching where the pool has it on (vLLM v1's default).

    Prefix caching: a request's full blocks are committed under their chain hashes once a step
    has written them (`commit_computed`), prompt and generated tokens alike, so a request
    preempted by recompute finds its own blocks again if nothing evicted them. A waiting request
    starts from the longest cached run of its blocks (`cached_prefix`)."""

    def __init__(self, pool: BlockPool, host_tier: PrefixHostTier | None = None):
        if host_tier is not None and pool.evicted is None:
            raise ValueError("a host tier needs a pool with prefix caching that records its moves")
        self.pool = pool
        self.block_size = pool.block_size
        self.host_tier = host_tier  # the second tier in host memory (memory/prefix_host_tier.py)
        if host_tier is not None:
            self.host_store = host_tier.store
        self.host_hits = 0  # tokens of cache hits loaded from the host tier
        # Blocks reserved to be completed by a chunk not yet committed: hash -> request id, and
        # each request's (`prefix_in_flight`).
        self._in_flight: dict[BlockHash, str] = {}
        self._in_flight_of: dict[str, list[BlockHash]] = {}

    @property
    def prefix_caching(self) -> bool:
        return self.pool.caching

    def cached_prefix(self, request: Request) -> int:
        max_blocks = (request.num_tokens - 1) // self.block_size
        device = len(self._hit(request, max_blocks))
        return (device + self._host_run(request, device, max_blocks)) * self.block_size

    def _host_run(self, request: Request, device: int, max_blocks: int) -> int:
        """Blocks past the `device` cached ones, up to `max_blocks`, that the host tier holds and
        would load rather than recompute; 0 without a tier."""
        tier = self.host_tier
        if tier is None or device >= max_blocks or not len(tier):
            return 0
        hashes = block_hashes(request.token_ids, self.block_size, request.block_hashes, max_blocks)
        run = tier.run(hashes[device:max_blocks])
        return run if tier.worth_loading(run, device * self.block_size) else 0

    def prefix_in_flight(self, request: Request) -> bool:
        if not self._in_flight or self.pool.has(request.request_id):
            return False
        max_blocks = (request.num_tokens - 1) // self.block_size
        cached = self.cached_prefix(request) // self.block_size
        if cached >= max_blocks:
            return False
        hashes = block_hashes(request.token_ids, self.block_size, request.block_hashes, cached + 1)
        owner = self._in_flight.get(hashes[cached])
        # An owner that no longer holds blocks (released by a manager that keeps its own
        # bookkeeping, such as a swap-out) left a stale mark: it computes nothing now.
        return owner is not None and owner != request.request_id and self.pool.has(owner)

    def _mark_in_flight(self, request: Request, num_tokens: int) -> None:
        """The full blocks `request`'s reservation up to `num_tokens` lets this step complete."""
        size = self.block_size
        if not self.pool.caching or num_tokens // size <= request.num_computed_tokens // size:
            return  # the chunk completes no block (most decodes): nothing to mark
        rid = request.request_id
        full = min(num_tokens, request.num_tokens) // self.block_size
        done = self.pool.num_committed(rid) + len(self._in_flight_of.get(rid, ()))
        if full <= done:
            return
        hashes = block_hashes(request.token_ids, self.block_size, request.block_hashes, full)
        marked = self._in_flight_of.setdefault(rid, [])
        for h in hashes[done:full]:
            self._in_flight.setdefault(h, rid)
            marked.append(h)

    def _clear_in_flight(self, rid: str) -> None:
        for h in self._in_flight_of.pop(rid, ()):
            if self._in_flight.get(h) == rid:
                del self._in_flight[h]

    def _offload(self) -> list[KVCopy]:
        """The saves of what the last allocation evicted, where a host tier keeps it."""
        return self.host_tier.offload(self.pool.take_evicted()) if self.host_tier is not None else []

    def step_copies(self, running: list[Request], window: float | None = None) -> list[KVCopy]:
        """With a host tier: the background saves of the cached blocks freed since the last step."""
        return self.host_tier.save_parked(self.pool.take_parked()) if self.host_tier is not None else []

    def _hit(self, request: Request, max_blocks: int) -> list[int]:
        """The cached blocks of `request`'s first `max_blocks` blocks, in order from the first."""
        if not self.pool.caching or max_blocks <= 0 or self.pool.has(request.request_id):
            return []
        hashes = block_hashes(request.token_ids, self.block_size, request.block_hashes, max_blocks)
        return self.pool.cached_blocks(hashes[:max_blocks])

    def _shared_prefix(self, request: Request, cached: int) -> list[int] | None:
        """The device blocks a new table starts with: the cached run of `request`'s first
        `cached` tokens on the device, the rest of which the host tier holds (to be loaded);
        None if part of it was evicted since `cached_prefix` counted it."""
        if not cached:
            return []
        if not self.pool.caching or cached % self.block_size or self.pool.has(request.request_id):
            raise ValueError(f"{request.request_id}: cannot share {cached} cached tokens")
        blocks = cached // self.block_size
        shared = self._hit(request, blocks)
        rest = blocks - len(shared)
        if rest and (self.host_tier is None
                     or self.host_tier.run(request.block_hashes[len(shared):blocks]) < rest):
            return None
        return shared

    def _count_lookup(self, request: Request, new_table: bool, cached: int) -> None:
        """vLLM's prefix-cache counters, in tokens: each request that got its first blocks asked
        for its tokens (queries) and found `cached` of them (hits)."""
        if not new_table or not self.pool.caching:
            return
        cache = self.pool.cache
        if cache is not None:
            cache.queries += request.num_tokens
            cache.hits += cached

    def commit_computed(self, request: Request) -> None:
        pool = self.pool
        if not pool.caching:
            return
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if full > pool.num_committed(request.request_id) and pool.has(request.request_id):
            pool.commit(request.request_id,
                        block_hashes(request.token_ids, self.block_size, request.block_hashes, full)[:full])
        if self._in_flight_of:
            self._clear_in_flight(request.request_id)

    def reset_prefix_cache(self) -> int:
        if self.host_tier is not None:
            self.host_tier.reset()
        return self.pool.reset_prefix_cache() if self.pool.caching else 0

    @property
    def events(self) -> dict[str, int]:
        cache = self.pool.cache
        if cache is None:
            return {}
        events = {"prefix_cache_queries": cache.queries, "prefix_cache_hits": cache.hits,
                  "prefix_cache_evictions": cache.evictions}
        if self.host_tier is not None:
            events.update(prefix_cache_host_hits=self.host_hits, prefix_cache_host_saves=self.host_tier.saves,
                          prefix_cache_host_loads=self.host_tier.loads)
        return events

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def can_reserve(self, request: Request, num_tokens: int) -> bool:
        return self.pool.can_allocate(request.request_id, num_tokens)

    def reserve(self, request: Request, num_tokens: int) -> list[KVCopy]:
        new_table = not self.pool.has(request.request_id)
        self.pool.allocate(request.request_id, num_tokens)
        self._count_lookup(request, new_table, 0)
        self._mark_in_flight(request, num_tokens)
        return self._offload()

    def try_reserve(self, request: Request, num_tokens: int) -> list[KVCopy] | None:
        new_table = not self.pool.has(request.request_id)
        if self.pool.try_allocate(request.request_id, num_tokens) is None:
            return None
        self._count_lookup(request, new_table, 0)
        self._mark_in_flight(request, num_tokens)
        return self._offload()

    def can_reserve_cached(self, request: Request, num_tokens: int, cached: int) -> bool:
        shared = self._shared_prefix(request, cached)
        return shared is not None and self.pool.can_allocate(request.request_id, num_tokens, shared)

    def try_reserve_cached(self, request: Request, num_tokens: int, cached: int) -> list[KVCopy] | None:
        shared = self._shared_prefix(request, cached)
        if shared is None or self.pool.try_allocate(request.request_id, num_tokens, shared) is None:
            return None
        self._count_lookup(request, True, cached)
        self._mark_in_flight(request, num_tokens)
        copies = self._offload()  # saves first (a group's issue order), then the loads into blocks just taken
        blocks = cached // self.block_size
        if len(shared) < blocks:
            assert self.host_tier is not None
            rid = request.request_id
            copies.append(self.host_tier.load(rid, request.block_hashes[len(shared):blocks],
                                              self.pool.block_table(rid)[len(shared):blocks]))
            self.pool.commit(rid, request.block_hashes[:blocks])  # loaded: shareable on the device again
            self.host_hits += cached - len(shared) * self.block_size
        return copies

    def block_table(self, request: Request) -> list[int]:
        return self.pool.block_table(request.request_id)

    def release(self, request: Request) -> None:
        self.pool.free(request.request_id)
        if self._in_flight_of:
            self._clear_in_flight(request.request_id)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.host_tier is not None:
            self.host_tier.check_invariants()


def build_paged(ctx: KVBuildContext) -> PagedKV:
    """The registry's builder for "paged" (see nanoserve/memory/__init__.py): prefix caching as
    the context says, with a host tier of `ctx.prefix_host_blocks` blocks of its host store."""
    if not ctx.prefix_host_blocks:
        return PagedKV(BlockPool(ctx.num_blocks, ctx.block_size, enable_prefix_caching=ctx.prefix_caching))
    if not ctx.prefix_caching or ctx.host_store is None:
        raise ValueError("a host tier for the prefix cache needs prefix caching on and a host KV store")
    pool = BlockPool(ctx.num_blocks, ctx.block_size, enable_prefix_caching=True, record_moves=True)
    return PagedKV(pool, PrefixHostTier(ctx.host_store, ctx.prefix_host_blocks,
                                        load_rule(ctx.link_block_seconds, ctx.recompute_seconds, ctx.block_size)))
