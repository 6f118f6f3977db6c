"""`swap`: vLLM's swap preemption (memory/swap.py). A hypothesis state machine with copies in
flight over small real caches; the real schedulers over it with a tagging executor; and greedy
output on a tiny Llama under a pool tight enough to force swaps."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_harness import HEAD_DIM, HEADS, LAYERS, StandInStream, TaggingExecutor, serve_random_requests
from mixed_greedy import MAX_TOKENS, PARAMS, PRIORITIES, PROMPTS, llama_dir, reference  # noqa: F401 (fixtures)
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory import KVBuildContext, make_kv_manager
from nanoserve.memory.blocks import BlockPool, NoFreeBlocksError
from nanoserve.memory.copies import LANDED_NOW, KVCopy
from nanoserve.memory.host import HostKVStore
from nanoserve.memory.swap import SwapKV
from nanoserve.request import Request
from nanoserve.sched import make_scheduler

B = 4
NAMES = [f"r{i}" for i in range(5)]


def make_swap(device_blocks: int, host_blocks: int) -> SwapKV:
    store = HostKVStore(host_blocks, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    return SwapKV(BlockPool(device_blocks, B), store)


def request(rid: str, tokens: int = 40) -> Request:
    return Request(rid, [1] * tokens, SamplingParams(max_tokens=8))


def computed(kv: SwapKV, tokens: int, rid: str = "r") -> Request:
    """A request whose first `tokens` tokens have K/V on the device."""
    r = request(rid)
    kv.reserve(r, tokens)
    r.num_computed_tokens = tokens
    return r


def land(kv: SwapKV, copies: list[KVCopy]) -> None:
    for copy in copies:
        kv.host_store.inflight.issue(copy, LANDED_NOW)
    kv.poll_copies()


# -- unit checks -----------------------------------------------------------------------------
def test_swap_out_copies_every_block_and_frees_them_at_once():
    kv = make_swap(6, 8)
    r = computed(kv, 10)
    table = list(kv.block_table(r))
    kept, copies = kv.preempt(r)
    assert kept == 10 and len(copies) == 1
    (save,) = copies
    # Whole blocks, the partly filled third included, and the step waits for it.
    assert save.kind == "save" and save.blocking and len(save.src) == 3 * B
    assert [s // B for s in save.src[::B]] == table
    assert kv.num_used_blocks == 0 and kv.host_store.num_free_blocks == 5 and kv.is_swapped(r)
    assert kv.events["swap_outs"] == 1 and kv.events["blocks_swapped_out"] == 3
    kv.check_invariants()


def test_a_swapped_request_comes_back_only_after_its_save_landed_and_then_whole():
    kv = make_swap(6, 8)
    r = computed(kv, 10)
    _, saves = kv.preempt(r)
    assert not kv.can_reserve(r, 11)  # vLLM never swaps in at the step it swapped out
    with pytest.raises(NoFreeBlocksError):
        kv.reserve(r, 11)
    land(kv, saves)
    assert kv.can_reserve(r, 11)
    (load,) = kv.reserve(r, 11)
    assert load.kind == "load" and load.reader == "r" and load.blocking and len(load.dst) == 3 * B
    assert list(load.src) == list(saves[0].dst)
    assert kv.host_store.num_free_blocks == 5  # the host copy is freed once the load lands
    land(kv, [load])
    assert kv.host_store.num_free_blocks == 8 and not kv.is_swapped(r)
    assert kv.events["swap_ins"] == 1 and kv.events["blocks_swapped_in"] == 3
    kv.check_invariants()


def test_no_host_room_falls_back_to_recompute():
    kv = make_swap(6, 2)
    r = computed(kv, 10)
    assert kv.preempt(r) == (0, []) and kv.num_used_blocks == 0 and not kv.is_swapped(r)
    assert kv.events["swap_fallbacks"] == 1
    assert kv.reserve(r, 4) == []  # a fresh start
    kv.check_invariants()


def test_release_before_a_swap_in_lands_holds_the_blocks_it_writes():
    kv = make_swap(6, 8)
    r = computed(kv, 8)
    land(kv, kv.preempt(r)[1])
    load = kv.reserve(r, 9)
    kv.release(r)  # aborted before the step that swapped it in is seen to land
    assert kv.pool.num_held_blocks == 2 and kv.host_store.num_free_blocks == 6
    kv.check_invariants()
    land(kv, load)
    assert kv.num_used_blocks == 0 and kv.host_store.num_free_blocks == 8
    kv.check_invariants()


def test_registered_with_a_host_store():
    store = HostKVStore(4, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    assert isinstance(make_kv_manager("swap", KVBuildContext(8, B, None, store)), SwapKV)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host KV store"):
        make_kv_manager("swap", KVBuildContext(8, B, None, None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only the option swap_budget_blocks"):
        make_kv_manager("swap", KVBuildContext(8, B, None, store, {"x": 1}))  # type: ignore[arg-type]
    budgeted = make_kv_manager("swap", KVBuildContext(8, B, None, store, {"swap_budget_blocks": 2}))  # type: ignore[arg-type]
    assert isinstance(budgeted, SwapKV) and budgeted.swap_budget_blocks == 2


def test_swap_budget_recomputes_victims_past_it_and_renews_each_step():
    """InferCept's per-iteration budget: a step swaps out at most `swap_budget_blocks` blocks;
    a victim past it is preempted by recompute; the next step has the whole budget again."""
    store = HostKVStore(16, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    kv = SwapKV(BlockPool(12, B), store, swap_budget_blocks=3)
    first, second, third = (computed(kv, 10, rid) for rid in ("r0", "r1", "r2"))  # 3 blocks each
    assert kv.step_copies([]) == []
    kept, saves = kv.preempt(first)
    assert kept == 10 and len(saves) == 1 and kv.is_swapped(first)
    assert kv.preempt(second) == (0, []) and not kv.is_swapped(second)  # 3 + 3 > 3: recomputed
    assert kv.events["swap_budget_fallbacks"] == 1 and kv.events["swap_fallbacks"] == 0
    kv.step_copies([])  # the next step
    kept, _ = kv.preempt(third)
    assert kept == 10 and kv.is_swapped(third)
    kv.check_invariants()


# -- state machine: grow, swap out, swap in, release, with copies in flight -----------------
def tag(rid: str, pos: int, layer: int, is_v: bool) -> torch.Tensor:
    base = 1 + NAMES.index(rid) * 1000 + pos + layer * 100_000
    base = -base if is_v else base
    return torch.tensor([[base, base + 0.5]], dtype=torch.float32)


DEVICE_BLOCKS, HOST_BLOCKS = 10, 8


class SwapMachine(RuleBasedStateMachine):
    """Copies are planned, issued (filed, data not moved), and land when the test says so, a
    prefix of the issue order at a time, as one copy stream delivers them; only then do they move
    data. A forward (`grow`) first waits for what its step must wait for: the blocking copies
    and the loads its request reads. It then writes new positions while later copies are still
    in flight: a block handed on too early would corrupt a host copy or a resident request."""

    def __init__(self):
        super().__init__()
        self.kv = make_swap(DEVICE_BLOCKS, HOST_BLOCKS)
        self.store = self.kv.host_store
        self.caches = [(torch.zeros(DEVICE_BLOCKS, B, HEADS, HEAD_DIM), torch.zeros(DEVICE_BLOCKS, B, HEADS, HEAD_DIM))
                       for _ in range(LAYERS)]
        self.requests = {rid: request(rid) for rid in NAMES}
        self.resident: set[str] = set()
        self.swapped: set[str] = set()
        self.stream = StandInStream(self.store, self.caches)

    @rule(count=st.integers(0, 3))
    def land(self, count):
        self.stream.land(count)

    @rule()
    def poll(self):
        """A step starts: the manager learns what landed; a new step's copies follow."""
        self.stream.issue()
        self.kv.poll_copies()
        self.stream.scrub(self.kv.pool._free)

    @rule(rid=st.sampled_from(NAMES), extra=st.integers(1, 6))
    def grow(self, rid, extra):
        r = self.requests[rid]
        if rid in self.swapped and not self.kv.can_reserve(r, r.num_computed_tokens + extra):
            return
        if rid not in self.swapped and not self.kv.can_reserve(r, r.num_computed_tokens + extra):
            return
        self.stream.planned += self.kv.reserve(r, r.num_computed_tokens + extra)
        self.a_swap_in_reads_only_a_landed_save()  # checked before the forward lands anything
        self.swapped.discard(rid)
        self.resident.add(rid)
        # The executor issues the step's copies, then the forward waits for what it needs.
        self.stream.issue()
        self.stream.land_what({rid})
        size = B
        table = self.kv.block_table(r)
        for pos in range(r.num_computed_tokens):  # what it reads is there now, other copies still in flight
            slot = table[pos // size] * size + pos % size
            for layer, (k, _v) in enumerate(self.caches):
                assert torch.equal(k.view(-1, HEADS, HEAD_DIM)[slot], tag(rid, pos, layer, False)), (rid, pos)
        for pos in range(r.num_computed_tokens, r.num_computed_tokens + extra):
            slot = table[pos // size] * size + pos % size
            for layer, (k, v) in enumerate(self.caches):
                k.view(-1, HEADS, HEAD_DIM)[slot] = tag(rid, pos, layer, False)
                v.view(-1, HEADS, HEAD_DIM)[slot] = tag(rid, pos, layer, True)
        r.num_computed_tokens += extra

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.resident)))
        r = self.requests[rid]
        kept, copies = self.kv.preempt(r)
        self.stream.planned += copies  # the save reads the blocks before anyone refills them
        self.stream.issue()
        self.stream.land_what(set())  # a blocking save: its step waits for it before anything else
        self.stream.scrub(self.kv.pool._free)
        assert kept in (0, r.num_computed_tokens)
        assert all(c.kind == "save" and c.blocking for c in copies)
        r.num_computed_tokens = kept
        self.resident.discard(rid)
        if kept:
            self.swapped.add(rid)

    @precondition(lambda self: self.resident or self.swapped)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.resident | self.swapped)))
        self.kv.release(self.requests[rid])
        self.stream.scrub(self.kv.pool._free)
        self.resident.discard(rid)
        self.swapped.discard(rid)
        self.requests[rid] = request(rid)  # a new request under the same name later

    @invariant()
    def manager_invariants(self):
        self.kv.check_invariants()
        for rid in self.swapped:
            assert self.kv.is_swapped(self.requests[rid])

    @invariant()
    def a_swap_in_reads_only_a_landed_save(self):
        unlanded = {s for c in self.stream.unlanded() if c.kind == "save" for s in c.dst}
        for c in self.stream.planned:
            if c.kind == "load":
                assert not unlanded & set(c.src), "a host copy is read before its save landed"

    @invariant()
    def every_position_reads_back_once_everything_lands(self):
        caches = [(k.clone(), v.clone()) for k, v in self.caches]
        store = HostKVStore(HOST_BLOCKS, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
        store.k.copy_(self.store.k), store.v.copy_(self.store.v)
        self.stream.replay(caches, store)
        for rid in self.resident:
            r = self.requests[rid]
            table = self.kv.block_table(r)
            for pos in range(r.num_computed_tokens):
                slot = table[pos // B] * B + pos % B
                for layer, (k, _v) in enumerate(caches):
                    assert torch.equal(k.view(-1, HEADS, HEAD_DIM)[slot], tag(rid, pos, layer, False)), (rid, pos)
        for rid in self.swapped:
            entry = self.kv._swapped[rid]
            slots = [s for b in entry.host_blocks for s in store.slots(b)][:entry.tokens]
            for pos, slot in enumerate(slots):
                for layer in range(LAYERS):
                    assert torch.equal(store.k[layer, slot], tag(rid, pos, layer, False)), (rid, pos)
                    assert torch.equal(store.v[layer, slot], tag(rid, pos, layer, True)), (rid, pos)

    def teardown(self):
        self.stream.drain()
        self.kv.poll_copies()
        for rid in self.resident | self.swapped:
            self.kv.release(self.requests[rid])
        assert self.kv.num_used_blocks == 0 and self.store.num_free_blocks == HOST_BLOCKS
        self.kv.check_invariants()


TestSwapMachine = SwapMachine.TestCase
TestSwapMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


# -- the real schedulers over swap, a model-free executor over real caches -------------------
SWAP_POLICIES = ["fcfs", "prefill-first", "priority", "priority-nonselective"]


@pytest.mark.parametrize("policy", SWAP_POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_schedulers_over_swap_restore_every_position(policy, seed):
    rng = random.Random(seed)
    device_blocks = 12
    kv = make_swap(device_blocks, 64)
    executor = TaggingExecutor(kv.host_store, device_blocks, B)
    config = SchedulerConfig(max_num_batched_tokens=rng.choice([8, 16, 48]), max_num_seqs=6,
                             max_model_len=device_blocks * B, policy=policy)
    engine = Engine(make_scheduler(config, kv), executor, tokenizer=None)
    assert serve_random_requests(engine, rng, max_tokens=(8, 24)) == 8
    assert executor.positions_checked > 0
    assert kv.num_used_blocks == 0 and kv.host_store.num_free_blocks == 64
    assert kv.events["swap_outs"] > 0 and kv.events["swap_ins"] == kv.events["swap_outs"]


# -- a tiny random Llama: greedy output survives swapping out and in -----------------------------------------
@pytest.mark.parametrize("policy", SWAP_POLICIES)
def test_greedy_output_survives_swapping(llama_dir, reference, policy):
    # 16 blocks for 8 requests of up to 43 tokens: preemption is certain, and every one swaps.
    llm = LLM(llama_dir, device="cpu", dtype="float32", kv_cache_tokens=64, block_size=B, policy=policy,
              kv_manager="swap", host_kv_tokens=2048)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=PRIORITIES)
    for ref, out in zip(reference, outputs):
        assert_close_greedy(ref, out, f"{policy} over swap: {out.prompt_token_ids[:4]}", max_tokens=MAX_TOKENS)
    kv = llm.engine.kv
    assert isinstance(kv, SwapKV)
    assert llm.engine.stats().num_preemptions > 0, "the KV pool was meant to force preemptions"
    assert kv.events["swap_outs"] > 0 and kv.events["swap_ins"] == kv.events["swap_outs"]
    assert kv.events["swap_fallbacks"] == 0
    assert llm.engine.stats().kv_blocks_used == 0 and kv.host_store.num_free_blocks == kv.host_store.num_blocks
