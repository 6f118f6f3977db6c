"""Automatic prefix caching (memory/prefix_cache.py, memory/blocks.py, PagedKV, Scheduler.try_chunk).

- The pool's bookkeeping, step by step: a commit makes blocks shareable, a hit shares them by
  reference count and takes free ones back from the LRU, eviction forgets hashes, tail first.
- A hypothesis state machine over `PagedKV` with caching on, with real slots that hold each
  position's token and prefix digest: after every step, the pool's invariants hold, every cached
  block holds exactly the tokens its hash was made of, and no block two requests share is written.
- Every policy over its own KV manager, where that manager caches: on shared-prefix work under
  a tight pool (preemption), outputs with caching on equal those with it off, every position
  read back holds what its tokens imply, and later requests do hit.
- The managers that cannot cache refuse to, naming why; the engine's default follows the manager.
- A real model (fp32): greedy tokens with caching on equal those with it off, torch and Triton.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_harness import HEAD_DIM, HEADS, LAYERS, ContentTaggingExecutor, MockClock

from nanoserve import LLM
from nanoserve.config import EngineArgs, SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory import (
    KV_MANAGER_NAMES,
    PREFIX_CACHING_MANAGERS,
    KVBuildContext,
    make_kv_manager,
    resolve_prefix_caching,
)
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.host import HostKVStore
from nanoserve.memory.manager import PagedKV
from nanoserve.memory.prefix_cache import block_hashes
from nanoserve.request import Request, RequestStatus
from nanoserve.sampling import SamplingParams
from nanoserve.sched import POLICY_MEMORY, SCHEDULERS, make_scheduler

B = 4


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4, ignore_eos=True))


def commit_all(kv: PagedKV, r: Request) -> None:
    r.num_computed_tokens = r.num_tokens
    kv.commit_computed(r)


def admit(kv: PagedKV, r: Request) -> int:
    """What `Scheduler.try_chunk` does for a waiting request: look up, then share and grow."""
    hit = kv.cached_prefix(r)
    r.num_computed_tokens = hit
    assert kv.try_reserve_cached(r, r.num_tokens, hit) is not None
    return hit


# -- the pool, step by step ------------------------------------------------------------------------
def test_a_committed_prefix_is_shared_by_reference():
    kv = PagedKV(BlockPool(8, B, enable_prefix_caching=True))
    a = request("a", list(range(10)))  # two full blocks and a partial one
    assert admit(kv, a) == 0
    commit_all(kv, a)
    b = request("b", list(range(8)) + [99, 98, 97])
    assert admit(kv, b) == 8  # both full blocks; the third differs
    assert kv.block_table(b)[:2] == kv.block_table(a)[:2] and kv.block_table(b)[2] != kv.block_table(a)[2]
    assert kv.num_used_blocks == 4  # 3 of a's + 1 of b's own
    assert kv.events["prefix_cache_hits"] == 8 and kv.events["prefix_cache_queries"] == 21
    kv.check_invariants()


def test_the_last_token_is_always_computed():
    kv = PagedKV(BlockPool(8, B, enable_prefix_caching=True))
    a = request("a", list(range(8)))
    admit(kv, a)
    commit_all(kv, a)
    same = request("same", list(range(8)))  # entirely cached: only 4 tokens shared, 4 to compute
    assert kv.cached_prefix(same) == 4
    longer = request("longer", list(range(9)))
    assert kv.cached_prefix(longer) == 8


def test_freed_cached_blocks_wait_in_lru_order_and_eviction_forgets_them():
    pool = BlockPool(4, B, enable_prefix_caching=True)
    kv = PagedKV(pool)
    a = request("a", list(range(12)))  # three blocks
    admit(kv, a)
    commit_all(kv, a)
    table = list(kv.block_table(a))
    kv.release(a)
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    assert pool.cache is not None and pool.cache.num_evictable == 3
    # A request of 2 blocks with nothing in common takes the never-cached block, then evicts the
    # tail of a's prefix (freed first, least recently), not its head.
    other = request("o", [50 + i for i in range(8)])
    admit(kv, other)
    assert table[2] in kv.block_table(other) and table[0] not in kv.block_table(other)
    assert pool.cache.evictions == 1
    again = request("a2", list(range(12)) + [7])
    assert kv.cached_prefix(again) == 8  # the first two blocks survived
    kv.check_invariants()


def computed(num_blocks: int, tokens: list[int]) -> tuple[BlockPool, PagedKV, Request]:
    """A caching pool where request "a" of `tokens` computed them all and committed its full blocks."""
    pool = BlockPool(num_blocks, B, enable_prefix_caching=True)
    kv = PagedKV(pool)
    a = request("a", tokens)
    admit(kv, a)
    commit_all(kv, a)
    return pool, kv, a


def cached_and_freed(num_blocks: int, tokens: list[int]) -> tuple[BlockPool, PagedKV]:
    """As `computed`, then "a" freed: its full blocks wait in the LRU, evictable."""
    pool, kv, a = computed(num_blocks, tokens)
    kv.release(a)
    return pool, kv


def test_a_hit_takes_a_free_cached_block_back():
    pool, kv = cached_and_freed(3, list(range(8)))
    b = request("b", list(range(8)) + [1, 2, 3, 4])
    assert kv.can_reserve_cached(b, 12, 8) is True  # 3 blocks: 2 evictable hits (taken back) + 1 new
    assert admit(kv, b) == 8 and pool.num_free_blocks == 0
    assert pool.cache is not None and pool.cache.num_evictable == 0
    kv.check_invariants()


def test_a_hit_evicted_before_reserve_fails_without_change():
    pool, kv = cached_and_freed(2, list(range(8)))
    b = request("b", list(range(8)) + [5])
    hit = kv.cached_prefix(b)
    assert hit == 8
    admit(kv, request("x", [40, 41, 42, 43, 44]))  # evicts both cached blocks
    b.num_computed_tokens = hit
    assert kv.try_reserve_cached(b, 9, hit) is None and not kv.can_reserve_cached(b, 9, hit)
    assert not pool.has("b")
    kv.check_invariants()


def test_retiring_blocks_and_held_blocks_are_shared_no_further():
    pool, kv, a = computed(8, list(range(9)))
    first = kv.block_table(a)[0]
    pool.retire([first])
    assert kv.cached_prefix(request("b", list(range(9)))) == 0
    pool.unretire()
    a2 = request("a2", list(range(12)))
    admit(kv, a2)
    commit_all(kv, a2)  # re-caches a2's own first block (a's copy lost its hash)
    kv.release(a)
    second = kv.block_table(a2)[1]
    pool.free("a2", hold=[second])
    assert pool.cache is not None and not pool.cache.is_cached(second)
    pool.unhold([second])
    kv.check_invariants()


def test_reset_forgets_everything_and_frees_the_evictable_blocks():
    pool, kv, a = computed(8, list(range(9)))
    assert kv.reset_prefix_cache() == 2
    assert kv.cached_prefix(request("b", list(range(9)))) == 0
    kv.release(a)
    assert pool.cache is not None and pool.cache.num_evictable == 0 and pool.num_free_blocks == 8
    kv.check_invariants()


def test_caching_off_shares_nothing():
    kv = PagedKV(BlockPool(8, B))
    a = request("a", list(range(9)))
    admit(kv, a)
    commit_all(kv, a)
    assert not kv.prefix_caching and kv.cached_prefix(request("b", list(range(9)))) == 0 and kv.events == {}


def test_block_hashes_chain_and_extend_once():
    tokens = list(range(10))
    known: list[bytes] = []
    assert len(block_hashes(tokens, B, known, 5)) == 2  # only full blocks
    first = list(known)
    assert block_hashes(tokens + [1, 2], B, known, 5) == first + block_hashes(tokens + [1, 2], B, [], 3)[2:]
    # The same block after a different parent has a different hash.
    assert block_hashes([9, 9, 9, 9] + tokens[4:8], B, [], 2)[1] != first[1]
    assert block_hashes(tokens, B, [], 2, extra_key=b"lora-1") != first


# -- a state machine with real slots -----------------------------------------------------------------
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]


class CachingPoolMachine(RuleBasedStateMachine):
    """Requests drawn from a few shared prefixes come, compute in chunks, grow, are preempted
    and finish over a small pool. The slots hold (token, digest of the prefix) per position; a
    write checks that no other live request holds the block it writes into."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(10, B, enable_prefix_caching=True)
        self.kv = PagedKV(self.pool)
        self.slots: dict[int, tuple[int, int]] = {}  # flat slot -> (token, digest) written there
        self.live: list[Request] = []  # holding blocks
        self.waiting: list[Request] = []
        self.count = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, 3), max_size=6))
    def arrive(self, prefix, tail):
        self.count += 1
        self.waiting.append(request(f"r{self.count}", prefix + tail))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        r = data.draw(st.sampled_from(self.waiting))
        hit = self.kv.cached_prefix(r)
        assert hit % B == 0 and hit < r.num_tokens
        r.num_computed_tokens = hit
        end = data.draw(st.integers(hit + 1, r.num_tokens))
        if self.kv.try_reserve_cached(r, end, hit) is None:
            r.num_computed_tokens = 0
            return
        self.waiting.remove(r)
        r.status = RequestStatus.RUNNING
        self.live.append(r)
        self._read_back(r, hit)
        self._compute(r, end)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data):
        r = data.draw(st.sampled_from(self.live))
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(data.draw(st.integers(1, 3)))  # a sampled token
        end = data.draw(st.integers(r.num_computed_tokens + 1, r.num_tokens))
        if self.kv.try_reserve(r, end) is not None:
            self._compute(r, end)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), finish=st.booleans())
    def leave(self, data, finish):
        r = data.draw(st.sampled_from(self.live))
        self.live.remove(r)
        self.kv.release(r)
        if not finish:  # preempted by recompute: waits again, with its tokens
            r.num_computed_tokens = 0
            r.status = RequestStatus.WAITING
            self.waiting.append(r)

    @rule()
    def reset(self):
        self.kv.reset_prefix_cache()

    def _read_back(self, r: Request, upto: int) -> None:
        for pos in range(upto):
            assert self.slots[self._slot(r, pos)] == (r.token_ids[pos], self._digest(r, pos)), (r.request_id, pos)

    def _compute(self, r: Request, end: int) -> None:
        table = self.kv.block_table(r)
        for pos in range(r.num_computed_tokens, end):
            block = table[pos // B]
            sharers = [o.request_id for o in self.live if o is not r and block in self.kv.block_table(o)]
            assert not sharers, f"{r.request_id} writes block {block}, which {sharers} hold too"
            self.slots[self._slot(r, pos)] = (r.token_ids[pos], self._digest(r, pos))
        r.num_computed_tokens = end
        self.kv.commit_computed(r)

    def _slot(self, r: Request, pos: int) -> int:
        return self.kv.block_table(r)[pos // B] * B + pos % B

    @staticmethod
    def _digest(r: Request, pos: int) -> int:
        return hash(tuple(r.token_ids[:pos + 1]))

    @invariant()
    def pool_is_consistent(self):
        self.kv.check_invariants()

    @invariant()
    def cached_blocks_hold_what_their_hashes_name(self):
        cache = self.pool.cache
        assert cache is not None
        for r in self.live:  # every cached block a live request holds is one it computed or shared
            table = self.kv.block_table(r)
            hashes = block_hashes(r.token_ids, B, r.block_hashes, len(table))
            for i, block in enumerate(table[:self.pool.num_committed(r.request_id)]):
                if cache.hash_of(block) is not None:
                    assert cache.hash_of(block) == hashes[i]
                    for off in range(B):
                        assert self.slots[block * B + off][0] == r.token_ids[i * B + off]


TestCachingPool = CachingPoolMachine.TestCase
TestCachingPool.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


# -- every policy whose manager caches: the same outputs, with hits ---------------------------------
CACHING_POLICIES = sorted(p for p in SCHEDULERS if POLICY_MEMORY[p] in PREFIX_CACHING_MANAGERS)
CACHING_POLICIES += [(p) + "+swap" for p in ("fcfs", "prefill-first") if POLICY_MEMORY[p] != "swap"]


def run_shared_prefix_work(policy_kv: str, caching: bool, num_blocks: int, seed: int):
    policy, _, kv_name = policy_kv.partition("+")
    kv_name = kv_name or POLICY_MEMORY[policy]
    clock = MockClock(1000.0)
    store = HostKVStore(16, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    kv = make_kv_manager(kv_name, KVBuildContext(num_blocks, B, None, store, prefix_caching=caching))  # type: ignore[arg-type]
    config = SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, max_model_len=kv.max_request_tokens,
                             policy=policy)
    executor = ContentTaggingExecutor(store, num_blocks, B)
    engine = Engine(make_scheduler(config, kv, clock=clock), executor, tokenizer=None)
    rng = random.Random(seed)
    system = [rng.randrange(1, 90) for _ in range(9)]
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for wave in range(3):
        for i in range(4):
            tail = [rng.randrange(1, 90) for _ in range(rng.randint(1, 5))]
            engine.add_request(system + tail, SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True),
                               f"w{wave}r{i}", priority=rng.choice(["online", "offline"]))
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            clock.now += 0.01
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.token_ids
                    cached[out.request_id] = out.num_cached_tokens
    assert len(outputs) == 12, f"{policy_kv}: {len(outputs)} of 12 finished"
    assert kv.num_used_blocks == 0
    # Every caching manager reports the cache's counters beside its own mechanisms' (the metrics).
    assert ("prefix_cache_hits" in kv.events) == caching
    assert not caching or kv.events["prefix_cache_hits"] >= sum(cached.values())  # re-admissions hit too
    return outputs, cached, engine.stats().num_preemptions, executor


@pytest.mark.parametrize("policy_kv", CACHING_POLICIES)
@pytest.mark.parametrize("num_blocks", [8, 24])
def test_caching_leaves_every_policys_outputs_unchanged(policy_kv, num_blocks):
    for seed in range(3):
        off, none_cached, _, _ = run_shared_prefix_work(policy_kv, False, num_blocks, seed)
        on, cached, _, executor = run_shared_prefix_work(policy_kv, True, num_blocks, seed)
        assert on == off, f"{policy_kv} seed {seed}: outputs changed with prefix caching"
        assert not any(none_cached.values())
        if num_blocks == 24:  # room to keep the system prompt cached between waves
            assert sum(cached.values()) >= 8 * 8, f"{policy_kv}: {cached}"
            assert executor.positions_shared > 0


def test_a_tight_pool_preempts_and_still_matches():
    """8 blocks of 4 for prompts of up to 14 tokens and outputs up to 10: fcfs must preempt."""
    preemptions = 0
    for seed in range(6):
        off, *_ = run_shared_prefix_work("fcfs", False, 8, seed)
        on, _, count, _ = run_shared_prefix_work("fcfs", True, 8, seed)
        assert on == off
        preemptions += count
    assert preemptions > 0


# -- who caches, who refuses --------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(set(KV_MANAGER_NAMES) - PREFIX_CACHING_MANAGERS - {"arena"}))
def test_managers_without_caching_refuse_it_and_say_why(name):
    store = HostKVStore(16, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    with pytest.raises(ValueError, match=f"the {name} KV manager does not support prefix caching: .+"):
        make_kv_manager(name, KVBuildContext(16, B, None, store, prefix_caching=True))  # type: ignore[arg-type]
    kv = make_kv_manager(name, KVBuildContext(16, B, None, store))  # type: ignore[arg-type]
    assert not kv.prefix_caching


def test_the_default_is_on_where_supported():
    assert EngineArgs().enable_prefix_caching is None
    assert resolve_prefix_caching("paged", None) and resolve_prefix_caching("swap", None)
    assert resolve_prefix_caching("checkpoint", None) and not resolve_prefix_caching("exact", None)
    assert not resolve_prefix_caching("paged", False)


def test_the_arena_refuses_prefix_caching(tiny_model):
    _, _, directory = tiny_model
    with pytest.raises(ValueError, match="arena KV manager does not support prefix caching"):
        LLM(str(directory), device="cpu", kv_manager="arena", enable_prefix_caching=True, kv_cache_tokens=256)


# -- a real model ------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_real_model_greedy_tokens_are_unchanged(tiny_model, backend):
    arch, _, directory = tiny_model
    if arch not in ("llama", "opt") or (backend == "triton" and arch != "llama"):
        pytest.skip("two architectures, one under the slow Triton interpreter")
    rng = random.Random(0)
    system = [rng.randrange(1, 500) for _ in range(40)]
    prompts = [system + [rng.randrange(1, 500) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    prompts.append(list(system[:32]))  # a prompt that is entirely a cached prefix (2 blocks of 16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for caching in (False, True):
        llm = LLM(str(directory), device="cpu", dtype="float32", kv_cache_tokens=1024, block_size=16,
                  max_num_batched_tokens=64, attention_backend=backend, enable_prefix_caching=caching)
        first = llm.generate(prompts[:1], params, use_tqdm=False)  # computes and caches the prefix
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        results[caching] = [o.token_ids for o in first + rest]
        cached = [o.num_cached_tokens for o in first + rest]
        if caching:
            assert cached[0] == 0 and all(c == 32 for c in cached[1:6]) and cached[6] == 16, cached
            assert llm.reset_prefix_cache() > 0
        else:
            assert not any(cached)
    assert results[True] == results[False]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1000))
def test_hits_never_exceed_queries(seed):
    """The counters the metrics export: hits are a share of queries, per admission."""
    kv = PagedKV(BlockPool(32, B, enable_prefix_caching=True))
    rng = random.Random(seed)
    for i in range(10):
        r = request(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8][:rng.randint(1, 8)] + [rng.randint(1, 3)] * rng.randint(0, 6))
        if kv.can_reserve(r, r.num_tokens):
            admit(kv, r)
            commit_all(kv, r)
        if rng.random() < 0.5:
            kv.release(r)
    events = kv.events
    assert 0 <= events["prefix_cache_hits"] <= events["prefix_cache_queries"]


# -- the simulator runs the same managers ------------------------------------------------------------
def test_the_simulator_caches_shared_system_prompts_and_conversations():
    from nanoserve.sim.simulation import SimConfig, simulate
    from nanoserve.sim.workloads import LengthDist, multi_turn_chat, poisson_arrivals, shared_system_prompt

    own = LengthDist("turn", mean_prompt=64, mean_output=64, min_prompt=8, max_prompt=256, min_output=8,
                     max_output=256)
    traces = {"system": shared_system_prompt(poisson_arrivals(8.0, n=120, seed=1), 2048, own, groups=2, seed=1),
              "chat": multi_turn_chat(poisson_arrivals(1.0, n=12, seed=2), 4, 20.0, own, system_len=512, seed=2)}
    for name, trace in traces.items():
        runs = {apc: simulate(SimConfig(policy="fcfs", enable_prefix_caching=apc), trace) for apc in (False, True)}
        off, on = runs[False], runs[True]
        assert off.unfinished == on.unfinished == 0 and len(on.records) == len(trace)
        assert "prefix_cache_hits" not in off.events
        hit_rate = on.events["prefix_cache_hits"] / on.events["prefix_cache_queries"]
        assert hit_rate > 0.5, (name, hit_rate)
        ttft = {apc: sum(r.ttft for r in run.records if r.ttft is not None) for apc, run in runs.items()}
        assert ttft[True] < ttft[False], name


def test_workload_prompts_share_exactly_their_group_prefix():
    from nanoserve.sim.workloads import TraceRequest, prompt_token_ids

    a = TraceRequest(0.0, 40, 4, prefix_group=3, prefix_len=32)
    b = TraceRequest(0.0, 50, 4, prefix_group=3, prefix_len=32)
    other = TraceRequest(0.0, 40, 4, prefix_group=4, prefix_len=32)
    ta, tb, to = (prompt_token_ids(r, i, r.prompt_len, 7) for i, r in enumerate((a, b, other)))
    assert ta[:32] == tb[:32] and ta[32:34] != tb[32:34] and ta[:2] != to[:2]
    assert prompt_token_ids(TraceRequest(0.0, 5, 1), 1, 5, 7) != prompt_token_ids(TraceRequest(0.0, 5, 1), 2, 5, 7)
    with pytest.raises(ValueError, match="prefix needs a group"):
        TraceRequest(0.0, 5, 1, prefix_len=3)


# -- cache-aware ordering (SGLang's longest prefix match) --------------------------------------------
def test_lpm_admits_the_longest_cached_prefix_first():
    store = HostKVStore(0, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    orders = {}
    for order in ("fcfs", "lpm"):
        kv = make_kv_manager("paged", KVBuildContext(64, B, None, store, prefix_caching=True))  # type: ignore[arg-type]
        config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=kv.max_request_tokens,
                                 policy="fcfs", policy_options={"waiting_order": order})
        engine = Engine(make_scheduler(config, kv), ContentTaggingExecutor(store, 64, B), tokenizer=None)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        engine.add_request(list(range(1, 21)), params, "warm")
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request([50 + i for i in range(20)], params, "cold")  # arrives first, nothing cached
        engine.add_request(list(range(1, 21)) + [7], params, "hot")  # 20 tokens cached
        finished = []
        while engine.has_unfinished_requests():
            finished += [o.request_id for o in engine.step() if o.finished]
        orders[order] = finished
    assert orders == {"fcfs": ["cold", "hot"], "lpm": ["hot", "cold"]}
    with pytest.raises(ValueError, match="waiting_order must be one of fcfs, lpm"):
        make_scheduler(SchedulerConfig(max_model_len=64, policy="fcfs", policy_options={"waiting_order": "x"}),
                       BlockPool(8, B))


# -- prefix-aware dispatch -------------------------------------------------------------------------------
def test_the_dispatcher_routes_by_prefix_only_when_loads_are_close():
    from nanoserve.cluster.cluster import Dispatcher
    from nanoserve.cluster.load import InstanceLoad

    def loads(used0: int, used1: int) -> list[InstanceLoad]:
        return [InstanceLoad(0, 100, used0, 0, 0, 0, 0), InstanceLoad(1, 100, used1, 0, 0, 0, 0)]

    hashes = block_hashes(list(range(64)), 16, [], 3)
    other = block_hashes(list(range(100, 164)), 16, [], 3)
    d = Dispatcher(prefix_slack=0.1)
    assert d.pick(loads(10, 0), 4, hashes) == 1  # nothing cached anywhere: least loaded
    d.reported(1)
    assert d.pick(loads(0, 5), 4, hashes) == 1  # 1 holds the prefix and is within 10 points
    d.reported(1)
    assert d.pick(loads(0, 50), 4, hashes) == 0  # too far behind: load wins
    d.reported(0)
    assert d.pick(loads(0, 5), 4, other) == 0  # another prefix: load decides
    assert d.prefix_routed == 1
    assert Dispatcher().pick(loads(0, 5), 4) == 0  # no hashes: load alone


def test_prefix_routing_raises_a_clusters_hit_rate():
    from nanoserve.sim.cluster import ClusterConfig, simulate_cluster
    from nanoserve.sim.simulation import SimConfig
    from nanoserve.sim.workloads import LengthDist, multi_turn_chat, poisson_arrivals

    own = LengthDist("turn", mean_prompt=200, mean_output=100, min_prompt=16, max_prompt=512, min_output=16,
                     max_output=512)
    trace = multi_turn_chat(poisson_arrivals(2.0, n=24, seed=3), 4, 15.0, own, system_len=512, seed=3)
    rates = {}
    for slack in (None, 0.1):
        result = simulate_cluster(ClusterConfig(SimConfig(policy="fcfs", enable_prefix_caching=True),
                                                num_instances=4, prefix_slack=slack), trace)
        assert result.unfinished == 0
        rates[slack] = result.events["prefix_cache_hits"] / result.events["prefix_cache_queries"]
    assert rates[0.1] > rates[None] + 0.2, rates
    with pytest.raises(ValueError, match="prefix caching runs on replicas"):
        ClusterConfig(SimConfig(policy="kunserve", enable_prefix_caching=True), drop=True)


# -- the host tier -----------------------------------------------------------------------------------
def tiered_engine(device_blocks: int, host_blocks: int, policy: str = "fcfs"):
    store = HostKVStore(host_blocks, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    kv = make_kv_manager("paged", KVBuildContext(device_blocks, B, None, store, prefix_caching=True,  # type: ignore[arg-type]
                                                 prefix_host_blocks=host_blocks))
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2, max_model_len=kv.max_request_tokens,
                             policy=policy)
    executor = ContentTaggingExecutor(store, device_blocks, B)
    return Engine(make_scheduler(config, kv), executor, tokenizer=None), kv, executor


def run_all(engine) -> dict[str, list[int]]:
    outputs = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return outputs


def test_a_block_evicted_to_the_host_is_loaded_back_and_reads_back_exactly():
    engine, kv, executor = tiered_engine(device_blocks=6, host_blocks=32)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    prefix = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # 3 blocks
    engine.add_request(prefix + [1], params, "a")
    run_all(engine)
    for i in range(3):  # unrelated work that needs the whole pool: a's cached blocks are evicted
        engine.add_request([40 + 10 * i + j for j in range(20)], params, f"x{i}")
        run_all(engine)
    assert kv.cached_prefix(Request("probe", prefix + [2], params)) == 12  # all three from the host
    checked = executor.positions_checked
    engine.add_request(prefix + [2], params, "b")
    run_all(engine)
    events = kv.events
    assert events["prefix_cache_host_saves"] >= 3 and events["prefix_cache_host_loads"] == 3
    assert events["prefix_cache_host_hits"] == 12
    assert executor.positions_checked > checked  # b read the loaded positions, and they held a's K/V
    kv.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_the_host_tier_leaves_outputs_unchanged(seed):
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 90) for _ in range(9)] for _ in range(3)]
    work = [(rng.choice(systems) + [rng.randrange(1, 90) for _ in range(rng.randint(1, 5))], rng.randint(1, 8))
            for _ in range(16)]
    results = {}
    for host_blocks in (0, 32):
        store = HostKVStore(max(host_blocks, 1), B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
        kv = make_kv_manager("paged", KVBuildContext(10, B, None, store, prefix_caching=True,  # type: ignore[arg-type]
                                                     prefix_host_blocks=host_blocks))
        config = SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=3, max_model_len=kv.max_request_tokens)
        engine = Engine(make_scheduler(config, kv), ContentTaggingExecutor(store, 10, B), tokenizer=None)
        outputs = {}
        for i, (prompt, n) in enumerate(work):
            engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), f"r{i}")
            if i % 4 == 3:
                outputs.update(run_all(engine))
        outputs.update(run_all(engine))
        results[host_blocks] = (outputs, kv.events)
    assert results[32][0] == results[0][0]
    assert results[32][1]["prefix_cache_hits"] >= results[0][1]["prefix_cache_hits"]


def test_the_host_tier_needs_the_paged_manager_with_caching():
    store = HostKVStore(8, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    with pytest.raises(ValueError, match="host tier"):
        make_kv_manager("paged", KVBuildContext(8, B, None, store, prefix_host_blocks=4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host tier .* paged"):
        LLM(device="cpu", kv_manager="swap", prefix_cache_host_tokens=256, kv_cache_tokens=256)
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(device="cpu", async_scheduling=True, prefix_cache_host_tokens=256, kv_cache_tokens=256)


def test_real_model_host_tier_loads_what_the_device_evicted(tiny_model):
    arch, _, directory = tiny_model
    if arch != "llama":
        pytest.skip("one architecture")
    rng = random.Random(1)
    system = [rng.randrange(1, 500) for _ in range(48)]
    others = [[rng.randrange(1, 500) for _ in range(100)] for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = {}
    for tier in (0, 2048):
        llm = LLM(str(directory), device="cpu", dtype="float32", kv_cache_tokens=128, block_size=16,
                  max_num_batched_tokens=64, enable_prefix_caching=tier > 0, prefix_cache_host_tokens=tier)
        outs = [llm.generate([system + [1]], params, use_tqdm=False)[0]]
        outs += llm.generate(others, params, use_tqdm=False)  # 2 x 7 blocks through an 8-block pool
        outs += llm.generate([system + [2, 3]], params, use_tqdm=False)
        results[tier] = [o.token_ids for o in outs]
        if tier:
            events = llm.engine.stats().kv_events
            assert events["prefix_cache_host_hits"] == 48 and outs[-1].num_cached_tokens == 48, events
    assert results[2048] == results[0]


def test_a_copy_marks_a_shared_block_until_it_lands():
    """A checkpoint's save still reads a shared block when its request is preempted: the block
    stays its other owner's, and if that owner frees it before the save lands it is held, not
    reused (nor cached), until `unhold`."""
    pool, kv, a = computed(6, list(range(9)))
    b = request("b", list(range(8)) + [5])
    assert admit(kv, b) == 8
    shared = kv.block_table(a)[0]
    pool.free("a", hold=[shared])
    assert pool.num_held_blocks == 0 and pool.num_hold_marks == 1 and shared in kv.block_table(b)
    kv.check_invariants()
    kv.release(b)
    assert pool.num_held_blocks == 1 and pool.cache is not None and not pool.cache.is_cached(shared)
    kv.check_invariants()
    pool.unhold([shared])
    assert pool.num_held_blocks == pool.num_hold_marks == 0 and pool.num_used_blocks == 0
    kv.check_invariants()
    with pytest.raises(ValueError, match="not held"):
        pool.unhold([shared])


def test_the_server_flags_are_vllms():
    import argparse

    from nanoserve.engine_flags import add_engine_arguments, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_args_from(parser.parse_args([])).enable_prefix_caching is None
    assert engine_args_from(parser.parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True
    off = engine_args_from(parser.parse_args(["--no-enable-prefix-caching", "--prefix-cache-host-tokens", "512"]))
    assert off.enable_prefix_caching is False and off.prefix_cache_host_tokens == 512
