"""ConServe's resident preemption and background prefetch (conserve.txt §4.4), at the scheduler:
`ConServeScheduler` over the real `CheckpointKV`, a model-free executor that checks every
position it reads back (kv_harness), and a mock clock.

- An offline request over the step's budget is paused: "checkpointing keeps KV caches in GPU
  memory until incoming online requests are scheduled". It resumes with no copy.
- A paused request's blocks are dropped only for a request that needs the memory (an online
  request, a running request that cannot grow, or an older parked request resuming), never to
  admit new offline work; the one with least to recompute goes first.
- A dropped request with a checkpoint is prefetched ahead, its loads split over steps within
  the link budget, while the requests behind it run ("launches a new offline batch and runs for
  its prefill phase, and meanwhile prefetches").
- A state machine drives arrivals of both classes, steps, and copies landing late, and checks
  after every step the manager's invariants, the parked requests' state, and that no forward
  reads a prefetched block before its load has landed.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kv_harness import HEAD_DIM, HEADS, LAYERS, MockClock, StandInStream, TaggingExecutor

from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.checkpoint import CheckpointConfig
from nanoserve.memory.checkpoint_kv import CheckpointKV
from nanoserve.memory.host import HostKVStore
from nanoserve.request import RequestStatus
from nanoserve.sampling import SamplingParams
from nanoserve.sched.conserve import ConServeScheduler
from nanoserve.sched.cost_model import CostModel
from nanoserve.sched.output import SchedulerOutput
from nanoserve.slo import SLO

B = 4
COST = CostModel(prefill_tokens=0.01, decode_seqs=0.01, iteration=0.01)  # 10 ms per step, token, decode
SLO_ = SLO(ttft=1.0, tpot=0.05)  # online decodes leave 30 ms: 3 offline decodes


class RecordingExecutor(TaggingExecutor):
    """Runs copies as the runner does (kv_harness), keeping each batch. With `late`, copies go on
    a stand-in copy stream and land only when the test says, except those the batch's forward
    must wait for (`KVCopy.needed_by`), which land first, as the runner's wait_event makes them:
    a forward that read a block whose load had not landed would read garbage."""

    def __init__(self, store, num_blocks, block_size, late=False):
        super().__init__(store, num_blocks, block_size)
        self.batches = []
        self.stream = StandInStream(store, self.caches) if late else None

    def execute(self, batch):
        self.batches.append(batch)
        if self.stream is None:
            return super().execute(batch)
        self.stream.planned += [copy for group in batch.kv_copies for copy in group]
        self.stream.issue()
        self.stream.land_what({c.request.request_id for c in batch.chunks})
        return super().execute(SchedulerOutput(chunks=batch.chunks, preempted=batch.preempted))


def build(num_blocks=24, budget=64, host_blocks=64, block_seconds=None, late=False, options=None):
    clock = MockClock()
    store = HostKVStore(host_blocks, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    kv = CheckpointKV(BlockPool(num_blocks, B), store, CheckpointConfig(threshold=0.0), block_seconds=block_seconds)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=num_blocks * B,
                             policy="conserve", policy_options=dict(options or {}))
    executor = RecordingExecutor(store, num_blocks, B, late)
    if late:  # the engine's idle settle waits for the stand-in stream, as for a real one
        store.synchronize = executor.stream.drain
    scheduler = ConServeScheduler(config, kv, cost_model=COST, clock=clock)
    return Engine(scheduler, executor, tokenizer=None), executor, clock


def add(engine, rid, prompt_len, max_tokens, priority):
    return engine.add_request([7] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid,
                              priority=priority, slo=SLO_ if priority == "online" else None)


def run_to_end(engine, clock, limit=800):
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        engine.step()
        clock.now += 0.01
    pytest.fail("requests did not finish")


def test_an_over_budget_offline_request_is_paused_with_its_kv_and_resumes_without_a_copy():
    engine, executor, clock = build(num_blocks=64)  # room for everyone: no memory pressure
    offline = [add(engine, f"off{i}", 8, 30, "offline") for i in range(5)]
    engine.step()  # offline batching mode: every prompt at once
    add(engine, "on", 4, 20, "online")
    engine.step()  # the online prompt, under TTFT: room for every offline decode too
    engine.step()  # online decoding: TPOT leaves room for 3 offline decodes; 2 are paused
    paused = executor.batches[-1].preempted
    assert [r.request_id for r in paused] == ["off4", "off3"]
    kv = engine.kv
    assert kv.events["pauses"] == 2 and kv.events["paused_dropped"] == 0
    for r in paused:  # the K/V stayed: same tokens, same blocks
        assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 9
        assert kv.pool.has(r.request_id) and kv.preemption_loss(r) <= r.num_computed_tokens
    run_to_end(engine, clock)
    assert kv.events["pauses_resumed"] >= 2 and kv.events["tokens_preempted"] == 0  # nothing was dropped
    assert kv.events["blocks_loaded_on_resume"] == kv.events["blocks_loaded_ahead"] == 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in offline)
    assert executor.positions_checked > 0 and kv.num_used_blocks == 0


def test_paused_blocks_go_to_an_online_request_least_to_recompute_first_never_to_new_offline_work():
    # 16 blocks: five offline requests take 13 by the third step, leaving 2 free and 4 paused.
    engine, executor, clock = build(num_blocks=16)
    for i in range(5):
        add(engine, f"off{i}", 7, 40, "offline")
    engine.step()
    add(engine, "on1", 4, 30, "online")
    engine.step()
    engine.step()  # off3, off4 paused (TPOT budget)
    kv, sched = engine.kv, engine.scheduler
    assert set(sched._parked) == {"off3", "off4"}
    add(engine, "off-new", 12, 4, "offline")  # new offline work: must not take parked blocks
    add(engine, "on2", 24, 4, "online")  # needs 6 blocks: only parked ones can give them
    losses = {r.request_id: kv.preemption_loss(r) for r in sched._parked.values()}
    engine.step()
    batch = executor.batches[-1]
    assert "on2" in {c.request.request_id for c in batch.chunks}
    assert "off-new" not in {c.request.request_id for c in batch.chunks}
    dropped = [r.request_id for r in batch.preempted if r.request_id in losses]
    assert dropped and kv.events["paused_dropped"] == len(dropped)
    assert losses[dropped[0]] == min(losses.values())  # least to recompute first
    for rid in dropped:  # the checkpoint kept what was saved (threshold 0: everything full)
        assert kv.checkpointer.is_preempted(rid)
    run_to_end(engine, clock)
    # Only the tails of partly filled blocks (never saved) were recomputed.
    assert kv.events["tokens_kept_on_host"] >= 0.8 * kv.events["tokens_preempted"] > 0
    assert executor.positions_checked > 0 and kv.num_used_blocks == 0


def offline_work_then_an_online_request_that_takes_its_memory(engine) -> None:
    """Four offline requests fill the pool; one online request decodes beside them; a second,
    long one needs the memory they hold, so some are preempted with checkpoints."""
    for i in range(4):
        add(engine, f"off{i}", 15, 60, "offline")
    engine.step()
    add(engine, "on1", 4, 6, "online")
    for _ in range(3):
        engine.step()
    add(engine, "on2", 28, 4, "online")  # takes offline requests' memory
    engine.step()


def test_a_dropped_request_is_prefetched_ahead_over_several_steps_while_new_work_runs():
    # One block's load takes 10 ms of link; the TPOT window (≤ 50 ms) moves a few per step.
    engine, executor, clock = build(num_blocks=20, block_seconds=0.01)
    offline_work_then_an_online_request_that_takes_its_memory(engine)
    kv = engine.kv
    assert kv.events["preemptions_with_checkpoint"] > 0
    add(engine, "off-new", 4, 4, "offline")
    run_to_end(engine, clock)
    events = kv.events
    assert events["blocks_loaded_ahead"] > 0 and events["blocks_loaded_on_resume"] == 0
    # Split: some step issued loads for a request that did not run in it and was not done yet.
    split = [c for b in executor.batches for g in b.kv_copies for c in g
             if c.kind == "load" and c.reader not in {ch.request.request_id for ch in b.chunks}]
    loads_per_request = {}
    for c in split:
        loads_per_request.setdefault(c.reader, []).append(c)
    assert any(len(v) > 1 for v in loads_per_request.values())
    assert executor.positions_checked > 0 and kv.num_used_blocks == 0


class ConServeMachine(RuleBasedStateMachine):
    """Arrivals of both classes, steps with the clock moving, copies landing late (only what a
    forward reads lands before it, the rest when the test says): after every step, the manager's
    invariants and parked requests waiting with their K/V on the device; at every drop of parked
    K/V, that it was for a request that needed the memory (online, running, or parked and older),
    never to admit new offline work. The executor checks every position a forward reads.
    `OPTIONS`: the policy's options (a subclass runs Fig. 8's no-prefetch bar, and the offline
    batching mode capped as it was before issue 45)."""

    OPTIONS: dict = {}

    def __init__(self):
        super().__init__()
        self.engine, self.executor, self.clock = build(num_blocks=16, budget=32, host_blocks=48,
                                                       block_seconds=0.004, late=True, options=self.OPTIONS)
        self.scheduler, self.kv = self.engine.scheduler, self.engine.kv
        self.count = 0
        make_room = self.scheduler._make_room

        def watched(request, num_new, out, online_victims):  # who takes parked K/V, when it is dropped
            parked = dict(self.scheduler._parked)
            was_running = request.status == RequestStatus.RUNNING
            result = make_room(request, num_new, out, online_victims)
            if set(parked) - set(self.scheduler._parked):
                assert request.priority == "online" or was_running or request.request_id in parked, \
                    f"a parked request's K/V was dropped to admit new offline work ({request.request_id})"
                self.drops += 1
            return result

        self.scheduler._make_room = watched
        self.drops = 0

    @rule(priority=st.sampled_from(["online", "offline"]), prompt=st.integers(1, 20), output=st.integers(1, 24))
    def arrive(self, priority, prompt, output):
        add(self.engine, f"r{self.count}", prompt, output, priority)
        self.count += 1

    @rule(steps=st.integers(1, 4), advance=st.sampled_from([0.0, 0.01, 0.05]))
    def step(self, steps, advance):
        for _ in range(steps):
            if not self.engine.has_unfinished_requests():
                return
            self.engine.step()
            self.clock.now += advance

    @rule(count=st.integers(0, 6))
    def land(self, count):
        self.executor.stream.land(count)

    @invariant()
    def parked_requests_wait_with_their_kv(self):
        self.kv.check_invariants()
        waiting = {r.request_id for r in self.scheduler.waiting}
        for rid, request in self.scheduler._parked.items():
            assert rid in waiting and request.status == RequestStatus.WAITING
            assert self.kv.pool.has(rid)

    def teardown(self):
        run_to_end(self.engine, self.clock, limit=3000)
        self.executor.stream.drain()
        self.engine.scheduler.settle()
        assert self.kv.num_used_blocks == 0 and self.kv.pool.num_held_blocks == 0
        assert self.kv.host_store.num_free_blocks == self.kv.host_store.num_blocks
        self.kv.check_invariants()


TestConServeMachine = ConServeMachine.TestCase
TestConServeMachine.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)


class ConServeNoPrefetchCappedMachine(ConServeMachine):
    OPTIONS = {"prefetch": False, "offline_batch_tokens": 32}


TestConServeNoPrefetchCappedMachine = ConServeNoPrefetchCappedMachine.TestCase
TestConServeNoPrefetchCappedMachine.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)
