"""KV memory managers: bookkeeping cost, checkpoint copy throughput, arena capacity gain.

Each section measures one of nanoserve's allocators against a plain peer in this process, on
the same work, and prints the ratio next to its goal:

1. Bookkeeping. The time one scheduler step spends in the allocator, with 1,000 running and
   10,000 waiting sequences, against vLLM's plain `BlockPool` (goal: at most 3x its time).
   One step is: every running sequence grows by one decode token; those that reach their
   output length finish and are freed (a few per step); waiting sequences are admitted, a
   prompt of some hundred tokens each, while fewer than 1,000 run and the allocator has room.
   Every allocator runs this same step on the same seeded trace:
     paged          `BlockPool`: allocate, free, can_allocate (the baseline)
     exact          `ExactAllocator`: admission with a predicted length (true length x 0.8-1.25,
                    so some requests overrun into the reserved pool), grow, ensure_resident for
                    evicted guests, free
     bidirectional  `BidirectionalBlockManager`: half the sequences best-effort
     checkpoint     the `BlockPool` step plus `IncrementalCheckpointer.plan_step` over every
                    running sequence, with device usage above its threshold
     arena          `MemoryArena` as the block allocator (BlockPool's interface)
     paged-kv       `PagedKV` over a `BlockPool`, driven through requests with token ids as the
                    scheduler drives it (lookup, reserve, commit), prefix caching off
     paged-kv-cached  the same with prefix caching on: the ratio of the two prices caching's
                    bookkeeping, hashing included (goal: at most 1.5x)
   Pools are sized so 1,000 running sequences fit (exact's padded reservations included), so
   no allocator stalls or preempts for lack of room and all do the same logical work (checked
   and printed). Only bookkeeping is timed: copies the managers return are not executed. The
   step includes the loop that calls the allocator, the same for all, as a scheduler has one.
   Allocators are stepped in interleaved rounds so machine noise hits all alike; medians.

2. Checkpoint copy throughput. `HostKVStore.execute` saving N whole blocks (every layer, K and
   V) to host blocks, against `Tensor.copy_` of the same bytes (each layer's block range into
   a preallocated host tensor): GB/s of both and the ratio (goal: at least 0.8x). Cache shape
   per layer: [blocks, 16, 8 KV heads, 64], fp16, 16 layers. The saved bytes are compared.

3. Arena capacity. A random Llama (hidden 512, 8 layers, GQA) moved into a `MemoryArena`; half
   the layers are dropped (KunServe). Measured gain: KV tokens allocatable afterwards (blocks
   actually allocated until the arena refuses, fragmentation included) minus what the old KV
   region holds at the new, smaller bytes per token. Theoretical gain: the dropped layers'
   parameter bytes (counted from the model) / KV bytes per token of the resident layers.
   Ratio measured / theoretical (goal: at least 0.95x).

    python benchmarks/memory.py [--json out.json]   # about 6 min on 2 cores, mostly BROS's setup
    python benchmarks/memory.py --sections 1 --allocators exact,arena   # paged always runs
    python benchmarks/memory.py --smoke   # tiny sizes, seconds on a CPU: CI keeps it working
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import date

import torch
from torch import nn

from nanoserve.memory.arena import ArenaConfig, MemoryArena
from nanoserve.memory.bidirectional import BidirectionalBlockManager
from nanoserve.memory.blocks import BlockPool, NoFreeBlocksError
from nanoserve.memory.checkpoint import CheckpointConfig, IncrementalCheckpointer
from nanoserve.memory.copies import LANDED_NOW
from nanoserve.memory.exact import ExactAllocator, ExactAllocConfig
from nanoserve.memory.host import HostKVStore, KVCopy
from nanoserve.memory.manager import PagedKV
from nanoserve.request import Request
from nanoserve.sampling import SamplingParams

BOOKKEEPING_GOAL = 3.0  # at most this many times BlockPool's step time
CACHING_GOAL = 1.5  # PagedKV with prefix caching: at most this many times its step time without
COPY_GOAL = 0.8  # at least this fraction of Tensor.copy_'s GB/s
ARENA_GOAL = 0.95  # at least this fraction of the theoretical capacity gain


# -- 1. bookkeeping -----------------------------------------------------------------------
@dataclass(frozen=True)
class SeqSpec:
    seq_id: int
    prompt: int
    output: int
    predicted: int  # what a length predictor would say (exact only)


@dataclass(frozen=True)
class Workload:
    running: int = 1000
    waiting: int = 10000
    prompt: tuple[int, int] = (100, 300)  # uniform, inclusive
    output: tuple[int, int] = (16, 256)
    prediction_error: tuple[float, float] = (0.8, 1.25)  # predicted = output x uniform(a, b)
    block_size: int = 16
    seed: int = 0

    def arrivals(self):
        """An endless, seeded stream of sequences: every allocator sees the same one."""
        rng = random.Random(self.seed)
        seq_id = 0
        while True:
            output = rng.randint(*self.output)
            predicted = max(1, round(output * rng.uniform(*self.prediction_error)))
            yield SeqSpec(seq_id, rng.randint(*self.prompt), output, predicted), rng.random()
            seq_id += 1


class Allocator:
    """One allocator behind the three calls a step makes. Each returns False when out of room."""

    name: str

    def admit(self, spec: SeqSpec, num_tokens: int) -> bool: ...

    def grow(self, spec: SeqSpec, num_tokens: int) -> bool: ...

    def finish(self, spec: SeqSpec) -> None: ...

    def end_step(self, running: dict[int, list]) -> None:
        """Per-step work past admission, given seq_id -> [spec, tokens] of every running
        sequence (the checkpointer plans its saves here)."""

    def events(self) -> dict[str, int]:
        return {}


class PagedAlloc(Allocator):
    name = "paged (BlockPool)"

    def __init__(self, pool: BlockPool | MemoryArena):
        self.pool = pool

    def admit(self, spec: SeqSpec, num_tokens: int) -> bool:
        if not self.pool.can_allocate(spec.seq_id, num_tokens):
            return False
        self.pool.allocate(spec.seq_id, num_tokens)
        return True

    def grow(self, spec: SeqSpec, num_tokens: int) -> bool:
        try:
            self.pool.allocate(spec.seq_id, num_tokens)
        except NoFreeBlocksError:
            return False
        return True

    def finish(self, spec: SeqSpec) -> None:
        self.pool.free(spec.seq_id)


class ArenaAlloc(PagedAlloc):
    name = "arena (MemoryArena)"


class PagedKVAlloc(Allocator):
    """`PagedKV` driven as the scheduler drives it, through requests with token ids: at admission
    the prefix-cache lookup, then the reservation; after each step the commit of the computed
    blocks. With caching off the lookup and the commit return at once: the pair prices prefix
    caching's bookkeeping (goal: at most `CACHING_GOAL`x the same manager with it off). Half the
    prompts open with one shared 64-token system prompt, so the cached run hits too."""

    def __init__(self, pool: BlockPool):
        self.kv = PagedKV(pool)
        self.name = f"paged-kv (PagedKV, prefix caching {'on' if pool.caching else 'off'})"
        self.requests: dict[int, Request] = {}
        self.system = list(range(1000, 1064))
        self.params = SamplingParams(max_tokens=1 << 20)

    def admit(self, spec: SeqSpec, num_tokens: int) -> bool:
        rng = random.Random(spec.seq_id)
        head = self.system if spec.seq_id % 2 else []
        ids = head + [rng.randrange(2, 30000) for _ in range(num_tokens - len(head))]
        request = Request(str(spec.seq_id), ids, self.params)
        hit = request.num_computed_tokens = self.kv.cached_prefix(request)
        if self.kv.try_reserve_cached(request, num_tokens, hit) is None:
            return False
        request.num_computed_tokens = num_tokens
        self.kv.commit_computed(request)
        self.requests[spec.seq_id] = request
        return True

    def grow(self, spec: SeqSpec, num_tokens: int) -> bool:
        request = self.requests[spec.seq_id]
        request.token_ids.append(num_tokens % 30000)
        if self.kv.try_reserve(request, num_tokens) is None:
            return False
        start, request.num_computed_tokens = request.num_computed_tokens, num_tokens
        if self.kv.prefix_caching and num_tokens // self.kv.block_size > start // self.kv.block_size:
            self.kv.commit_computed(request)  # as Scheduler.update_after_step: a chunk that fills a block
        return True

    def finish(self, spec: SeqSpec) -> None:
        self.kv.release(self.requests.pop(spec.seq_id))

    def events(self) -> dict[str, int]:
        return self.kv.events


class CheckpointAlloc(PagedAlloc):
    name = "checkpoint (BlockPool + plan_step)"

    def __init__(self, pool: BlockPool, store: HostKVStore, config: CheckpointConfig):
        super().__init__(pool)
        self.checkpointer = IncrementalCheckpointer(pool, store, config)

    def finish(self, spec: SeqSpec) -> None:
        self.checkpointer.release(spec.seq_id)

    def end_step(self, running: dict[int, list]) -> None:
        copies = self.checkpointer.plan_step({seq_id: tokens for seq_id, (_, tokens) in running.items()})
        # Not executed, but issued and landed at once, and polled as the next step's start does:
        # the checkpointer frees what an in-flight save held only when it hears it landed.
        ledger = self.checkpointer.store.inflight
        for copy in copies:
            ledger.issue(copy, LANDED_NOW)
        ledger.poll()

    def events(self) -> dict[str, int]:
        return {"blocks_checkpointed": self.checkpointer.blocks_checkpointed,
                "device_usage_%": round(100 * self.checkpointer.device_usage)}


class ExactAlloc(Allocator):
    name = "exact (ExactAllocator)"

    def __init__(self, allocator: ExactAllocator):
        self.alloc = allocator

    def admit(self, spec: SeqSpec, num_tokens: int) -> bool:
        try:
            self.alloc.admit(spec.seq_id, spec.prompt, spec.predicted)
        except NoFreeBlocksError:
            return False
        self.alloc.grow(spec.seq_id, num_tokens)  # inside the reservation: never preempts
        return True

    def grow(self, spec: SeqSpec, num_tokens: int) -> bool:
        alloc, seq_id = self.alloc, spec.seq_id
        try:
            if not alloc.is_resident(seq_id):
                alloc.ensure_resident(seq_id)  # an evicted guest comes back (its loads)
            alloc.grow(seq_id, num_tokens - alloc.num_written(seq_id))
            return True
        except NoFreeBlocksError:
            if not alloc.is_resident(seq_id):
                return False  # no room to restore it yet: it waits
        # Past its prediction and the reserved pool is dry (§3.2.2): preempt it, recompute.
        written = alloc.num_written(seq_id)
        new_prediction = alloc.preempt(seq_id, generated=max(0, written - spec.prompt))
        try:
            alloc.admit(seq_id, written, new_prediction)
        except NoFreeBlocksError:
            raise RuntimeError("the pool is too small for the workload") from None
        alloc.grow(seq_id, num_tokens)
        return True

    def finish(self, spec: SeqSpec) -> None:
        self.alloc.free(spec.seq_id)

    def events(self) -> dict[str, int]:
        a = self.alloc
        return {"hosted_placements": a.hosted_placements, "hosted_evictions": a.hosted_evictions,
                "reserved_pool_draws": a.reserved_pool_draws, "preemptions": a.preemptions}


class BidirectionalAlloc(Allocator):
    name = "bidirectional (BROS)"

    def __init__(self, manager: BidirectionalBlockManager):
        self.manager = manager

    def admit(self, spec: SeqSpec, num_tokens: int) -> bool:
        best_effort = spec.seq_id % 2 == 1
        if not self.manager.can_allocate(spec.seq_id, num_tokens, best_effort=best_effort):
            return False
        self.manager.allocate(spec.seq_id, num_tokens, best_effort=best_effort)
        return True

    def grow(self, spec: SeqSpec, num_tokens: int) -> bool:
        try:
            self.manager.allocate(spec.seq_id, num_tokens, best_effort=spec.seq_id % 2 == 1)
        except NoFreeBlocksError:
            return False
        return True

    def finish(self, spec: SeqSpec) -> None:
        self.manager.free(spec.seq_id)

    def events(self) -> dict[str, int]:
        m = self.manager
        return {"rt_on_be_blocks": m.preemptions, "overwrites": m.overwrites}


@dataclass
class Driver:
    """Runs the workload's steps on one allocator and records what each step did."""

    alloc: Allocator
    workload: Workload
    running: dict[int, list] = field(default_factory=dict)  # seq_id -> [spec, length]
    waiting: deque = field(default_factory=deque)
    step_us: list[float] = field(default_factory=list)
    trace: list[tuple[int, int]] = field(default_factory=list)  # (finished, admitted) per step
    stalls: int = 0

    def __post_init__(self) -> None:
        self._arrivals = self.workload.arrivals()
        for _ in range(self.workload.running):  # staggered: some just admitted, some nearly done
            spec, progress = next(self._arrivals)
            length = spec.prompt + int(progress * spec.output)
            if not self.alloc.admit(spec, length):
                raise RuntimeError(f"{self.alloc.name}: the pool cannot hold the initial running set")
            self.running[spec.seq_id] = [spec, length]
        self.waiting.extend(next(self._arrivals)[0] for _ in range(self.workload.waiting))

    def step(self) -> None:
        alloc, running = self.alloc, self.running
        start = time.perf_counter()
        done = []
        for entry in running.values():  # decode: one more token each
            spec, length = entry
            if alloc.grow(spec, length + 1):
                entry[1] = length + 1
                if length + 1 - spec.prompt >= spec.output:
                    done.append(spec)
            else:
                self.stalls += 1
        for spec in done:
            alloc.finish(spec)
            del running[spec.seq_id]
        admitted = 0
        while len(running) < self.workload.running and self.waiting:
            spec = self.waiting[0]
            if not alloc.admit(spec, spec.prompt):
                break
            self.waiting.popleft()
            running[spec.seq_id] = [spec, spec.prompt]
            admitted += 1
        alloc.end_step(running)
        self.step_us.append((time.perf_counter() - start) * 1e6)
        self.waiting.extend(next(self._arrivals)[0] for _ in range(admitted))  # new arrivals
        self.trace.append((len(done), admitted))


class _TinyModel(nn.Module):
    """Two decoder 'layers' of parameters: all the arena needs to lay out weights."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(64))
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))


def pool_blocks(workload: Workload, exact: ExactAllocConfig, headroom: float = 1.25) -> int:
    """Blocks for the running set's exact reservations (the largest footprint of all the
    allocators), plus exact's reserved pool and `headroom`."""
    arrivals = workload.arrivals()

    def reserve(s: SeqSpec) -> int:
        return -(-(s.prompt + s.predicted + math.ceil(s.predicted * exact.padding_ratio)) // exact.block_size)

    footprint = sum(reserve(next(arrivals)[0]) for _ in range(workload.running))
    return math.ceil(headroom * footprint / (1 - exact.reserved_fraction))


ALLOCATORS = ("paged", "exact", "bidirectional", "checkpoint", "arena", "paged-kv", "paged-kv-cached")


def make_allocator(name: str, workload: Workload, num_blocks: int) -> Allocator:
    B = workload.block_size

    def host() -> HostKVStore:  # bookkeeping only
        return HostKVStore(num_blocks, B, 1, 1, 1, torch.float32, pin_memory=False)

    if name == "paged":
        return PagedAlloc(BlockPool(num_blocks, B))
    if name == "exact":
        return ExactAlloc(ExactAllocator(num_blocks, ExactAllocConfig(block_size=B), host()))
    if name == "bidirectional":
        return BidirectionalAlloc(BidirectionalBlockManager(num_blocks, B, host()))
    if name == "checkpoint":
        return CheckpointAlloc(BlockPool(num_blocks, B), host(), CheckpointConfig(threshold=0.5))
    if name in ("paged-kv", "paged-kv-cached"):
        return PagedKVAlloc(BlockPool(num_blocks, B, enable_prefix_caching=name == "paged-kv-cached"))
    if name == "arena":
        config = ArenaConfig(B, 1, 1, torch.float32, kv_blocks=num_blocks, weight_align=4)
        return ArenaAlloc(MemoryArena(_TinyModel(), config))
    raise ValueError(f"unknown allocator {name!r}; choose from {', '.join(ALLOCATORS)}")


def bench_bookkeeping(workload: Workload, names: list[str], rounds: int, steps_per_round: int,
                      round_budget_s: float, warmup: int) -> dict:
    """Interleaved rounds: each allocator runs `steps_per_round` steps (fewer if one round
    exceeds `round_budget_s`, at least one), then the next; median microseconds per step."""
    num_blocks = pool_blocks(workload, ExactAllocConfig(block_size=workload.block_size))
    drivers = []
    for name in ["paged", *(n for n in names if n != "paged")]:  # the baseline first
        start = time.perf_counter()
        alloc = make_allocator(name, workload, num_blocks)
        drivers.append(Driver(alloc, workload))
        print(f"  set up {alloc.name}: {time.perf_counter() - start:.1f} s", flush=True)
    for driver in drivers:
        for _ in range(warmup):
            driver.step()
        driver.step_us.clear()
    for _ in range(rounds):
        for driver in drivers:
            deadline = time.perf_counter() + round_budget_s
            for _i in range(steps_per_round):
                driver.step()
                if time.perf_counter() > deadline:
                    break
    base = statistics.median(drivers[0].step_us)
    rows = []
    for driver in drivers:
        n = len(driver.step_us)
        same = driver.trace[:n] == drivers[0].trace[:n] if driver is not drivers[0] else True
        rows.append({"allocator": driver.alloc.name, "median_us": statistics.median(driver.step_us),
                     "steps": n, "ratio": statistics.median(driver.step_us) / base, "stalls": driver.stalls,
                     "same_work_as_paged": same, "finished": sum(f for f, _ in driver.trace),
                     "events": driver.alloc.events()})
    return {"num_blocks": num_blocks, "workload": asdict(workload), "rows": rows}


def print_bookkeeping(result: dict) -> None:
    w = result["workload"]
    print(f"\n== 1. Bookkeeping per step: {w['running']} running, {w['waiting']} waiting, "
          f"{result['num_blocks']} blocks of {w['block_size']} ==")
    print(f"(goal: at most {BOOKKEEPING_GOAL:g}x BlockPool)")
    print("| allocator | median µs/step | steps timed | vs BlockPool | goal | same work | events |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        goal = "baseline" if r is result["rows"][0] else \
            ("met" if r["ratio"] <= BOOKKEEPING_GOAL else "NOT met")
        same = "yes" if r["same_work_as_paged"] and not r["stalls"] else f"no ({r['stalls']} stalls)"
        events = ", ".join(f"{k} {v}" for k, v in r["events"].items()) or "-"
        print(f"| {r['allocator']} | {r['median_us']:.0f} | {r['steps']} | {r['ratio']:.2f}x | {goal} | "
              f"{same} | {events} |")
    by_name = {r["allocator"]: r for r in result["rows"]}
    off, on = (by_name.get(f"paged-kv (PagedKV, prefix caching {s})") for s in ("off", "on"))
    if off is not None and on is not None:
        ratio = on["median_us"] / off["median_us"]
        print(f"prefix caching's bookkeeping: {ratio:.2f}x PagedKV without it (goal: at most {CACHING_GOAL:g}x: "
              f"{'met' if ratio <= CACHING_GOAL else 'NOT met'})")


# -- 2. checkpoint copy throughput ----------------------------------------------------------
@dataclass(frozen=True)
class CopyCase:
    layers: int = 16
    block_size: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float16"
    device_blocks: int = 1024
    saved_blocks: int = 512

    @property
    def block_bytes(self) -> int:
        element = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * element


def timed(fn: Callable[[], None], repeats: int) -> list[float]:
    """Wall-clock seconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def bench_copy(case: CopyCase, repeats: int) -> dict:
    dtype, B, H, D = getattr(torch, case.dtype), case.block_size, case.kv_heads, case.head_dim
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(case.device_blocks, B, H, D, generator=g).to(dtype),
               torch.randn(case.device_blocks, B, H, D, generator=g).to(dtype)) for _ in range(case.layers)]
    store = HostKVStore(case.saved_blocks, B, case.layers, H, D, dtype, pin_memory=False)
    host_blocks = store.allocate("bench", case.saved_blocks)
    first, n = case.device_blocks // 4, case.saved_blocks  # device blocks [first, first + n)
    src = tuple(range(first * B, (first + n) * B))
    dst = tuple(s for b in host_blocks for s in store.slots(b))
    copies = [KVCopy("save", src, dst)]
    peer_k, peer_v = torch.empty_like(store.k), torch.empty_like(store.v)
    lo, hi = min(host_blocks) * B, (max(host_blocks) + 1) * B  # the host blocks are one run

    def ours() -> None:
        store.execute(copies, caches)
        store.inflight.poll()  # the next step's start: the same copy may be issued again

    def peer() -> None:
        for layer, (k, v) in enumerate(caches):
            peer_k[layer, lo:hi].copy_(k[first:first + n].view(-1, H, D))
            peer_v[layer, lo:hi].copy_(v[first:first + n].view(-1, H, D))

    ours(), peer()  # warm-up, and the check below
    identical = torch.equal(store.k, peer_k) and torch.equal(store.v, peer_v)
    ours_s, peer_s = [], []
    for _ in range(repeats):  # interleaved
        ours_s += timed(ours, 1)
        peer_s += timed(peer, 1)
    nbytes = n * case.block_bytes
    ours_gbs, peer_gbs = nbytes / statistics.median(ours_s) / 1e9, nbytes / statistics.median(peer_s) / 1e9
    return {"case": asdict(case), "bytes": nbytes, "ours_gb_s": ours_gbs, "peer_gb_s": peer_gbs,
            "ratio": ours_gbs / peer_gbs, "identical": identical, "repeats": repeats}


def print_copy(result: dict) -> None:
    c = result["case"]
    print(f"\n== 2. Checkpoint copy throughput: save {c['saved_blocks']} whole blocks "
          f"({result['bytes'] / 2**20:.0f} MiB: {c['layers']} layers x K,V x [{c['block_size']}, "
          f"{c['kv_heads']}, {c['head_dim']}] {c['dtype']}), CPU cache -> host ==")
    print(f"HostKVStore.execute : {result['ours_gb_s']:6.2f} GB/s")
    print(f"Tensor.copy_ (peer) : {result['peer_gb_s']:6.2f} GB/s")
    goal = "met" if result["ratio"] >= COPY_GOAL else "NOT met"
    print(f"ratio execute / copy_ = {result['ratio']:.2f}x (goal: at least {COPY_GOAL:g}x: {goal}); "
          f"saved bytes identical: {'yes' if result['identical'] else 'NO'}")


# -- 3. arena capacity ----------------------------------------------------------------------
@dataclass(frozen=True)
class ArenaCase:
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1536
    vocab: int = 32000
    dtype: str = "float16"  # weights and KV
    block_size: int = 16
    kv_blocks: int = 512


def bench_arena(case: ArenaCase) -> dict:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=case.vocab, hidden_size=case.hidden,
                                      intermediate_size=case.intermediate, num_hidden_layers=case.layers,
                                      num_attention_heads=case.heads, num_key_value_heads=case.kv_heads,
                                      tie_word_embeddings=False)
    dtype = getattr(torch, case.dtype)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    head_dim = case.hidden // case.heads
    arena = MemoryArena(model, ArenaConfig(case.block_size, case.kv_heads, head_dim, dtype, case.kv_blocks))
    dropped = list(range(case.layers // 2, case.layers))  # adjacent layers: KunServe drops a half
    param_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                      if any(f"layers.{layer}." in name for layer in dropped))
    kv_region_bytes = arena.total_bytes - arena.weight_bytes
    before = arena.capacity_tokens

    change = arena.drop_layers(dropped)
    arena.check_invariants()
    bpt = arena.kv_bytes_per_token
    allocated = 0
    while arena.num_free_blocks:  # allocate until the arena refuses: fragmentation counts
        arena.allocate(f"s{allocated}", case.block_size)
        allocated += 1
    try:
        arena.allocate("one-more", case.block_size)
        refused = False
    except NoFreeBlocksError:
        refused = True
    arena.check_invariants(check_weight_bytes=False)
    after = allocated * case.block_size
    old_region_tokens = kv_region_bytes // bpt  # the old KV bytes at the new, smaller per-token size
    measured, theoretical = after - old_region_tokens, param_bytes / bpt
    return {"case": asdict(case), "dropped_layers": dropped, "capacity_before": before, "tokens_after": after,
            "old_region_tokens_after": old_region_tokens, "measured_gain": measured,
            "theoretical_gain": theoretical, "change_tokens": change.tokens, "freed_param_bytes": param_bytes,
            "freed_page_bytes": change.weight_bytes, "kv_bytes_per_token": bpt, "ratio": measured / theoretical,
            "refused_past_capacity": refused}


def print_arena(result: dict) -> None:
    c = result["case"]
    print(f"\n== 3. Arena capacity: random Llama (hidden {c['hidden']}, {c['layers']} layers, "
          f"{c['kv_heads']} KV heads, {c['dtype']}), drop layers {result['dropped_layers']} ==")
    print(f"KV tokens before the drop        : {result['capacity_before']}")
    print(f"KV tokens allocatable after      : {result['tokens_after']} "
          f"(old KV region alone: {result['old_region_tokens_after']} at {result['kv_bytes_per_token']} B/token)")
    print(f"gain from the dropped weights    : {result['measured_gain']} tokens measured, "
          f"{result['theoretical_gain']:.0f} theoretical ({result['freed_param_bytes']} parameter bytes)")
    goal = "met" if result["ratio"] >= ARENA_GOAL else "NOT met"
    print(f"ratio measured / theoretical = {result['ratio']:.3f}x (goal: at least {ARENA_GOAL:g}x: {goal})")


# -- main -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a check that runs in seconds")
    parser.add_argument("--sections", default="1,2,3", help="comma-separated subset of 1,2,3")
    parser.add_argument("--allocators", default=",".join(ALLOCATORS),
                        help="section 1: comma-separated subset of %(default)s (paged always runs: the baseline)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    sections = {int(s) for s in args.sections.split(",")}
    names = args.allocators.split(",")

    print(f"{date.today().isoformat()}; {platform.processor() or platform.machine()}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; smoke={args.smoke}")
    results: dict = {"date": date.today().isoformat(), "machine": platform.platform(),
                     "torch_threads": torch.get_num_threads(), "smoke": args.smoke}
    ok = True
    if 1 in sections:
        if args.smoke:
            book = bench_bookkeeping(Workload(running=40, waiting=100), names, rounds=2, steps_per_round=3,
                                     round_budget_s=1.0, warmup=1)
        else:
            book = bench_bookkeeping(Workload(), names, rounds=5, steps_per_round=40, round_budget_s=3.0, warmup=2)
        print_bookkeeping(book)
        results["bookkeeping"] = book
    if 2 in sections:
        case = CopyCase(layers=2, kv_heads=2, head_dim=16, dtype="float32", device_blocks=16, saved_blocks=8) \
            if args.smoke else CopyCase()
        copy = bench_copy(case, repeats=3 if args.smoke else 9)
        print_copy(copy)
        ok &= copy["identical"]
        results["copy"] = copy
    if 3 in sections:
        case = ArenaCase(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128, vocab=512, kv_blocks=16) \
            if args.smoke else ArenaCase()
        arena = bench_arena(case)
        print_arena(arena)
        ok &= arena["refused_past_capacity"]
        results["arena"] = arena
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
