"""The round-robin policy (bros.txt §2.2; BROS's "RR" baseline): RT (online) and BE (offline)
requests in two FCFS queues, served one class per iteration in turns, over the paged pool with
recompute preemption. Driven through the real Engine by a model-free executor; a hypothesis state
machine checks the turn-taking and the queues after every step."""
from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_harness import HEAD_DIM, HEADS, LAYERS, TaggingExecutor

from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.host import HostKVStore
from nanoserve.request import RequestStatus
from nanoserve.sampling import SamplingParams
from nanoserve.sched import POLICY_MEMORY, SCHEDULERS, make_scheduler
from nanoserve.sched.round_robin import RoundRobinScheduler

B = 4


class RecordingExecutor(TaggingExecutor):
    """Checks every chunk's K/V (TaggingExecutor) and keeps every batch."""

    def __init__(self, num_blocks: int):
        super().__init__(HostKVStore(0, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False), num_blocks, B)
        self.batches = []

    def execute(self, batch):
        self.batches.append(batch)
        return super().execute(batch)


def make_engine(num_blocks=32, budget=64, max_seqs=8):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=num_blocks * B,
                             policy="round-robin")
    executor = RecordingExecutor(num_blocks)
    engine = Engine(make_scheduler(config, BlockPool(num_blocks, B)), executor, tokenizer=None)
    return engine, executor


def run(engine, max_steps=5000) -> dict:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("requests did not finish")


def classes(batch) -> set[str]:
    return {c.request.priority for c in batch.chunks}


def test_registered_with_paged_memory():
    assert SCHEDULERS["round-robin"].endswith(":RoundRobinScheduler") and POLICY_MEMORY["round-robin"] == "paged"
    engine, _ = make_engine()
    assert isinstance(engine.scheduler, RoundRobinScheduler)


def test_classes_take_turns_one_per_iteration():
    engine, executor = make_engine()
    for i in range(2):
        engine.add_request([1] * 5, SamplingParams(max_tokens=6, ignore_eos=True), f"rt{i}", priority="online")
        engine.add_request([2] * 5, SamplingParams(max_tokens=6, ignore_eos=True), f"be{i}", priority="offline")
    run(engine)
    served = [classes(batch) for batch in executor.batches]
    assert all(len(s) == 1 for s in served)  # never both classes in one iteration
    order = [s.pop() for s in served]
    # RT first, then strictly alternating while both classes have work: 6 iterations each.
    assert order == ["online", "offline"] * 6
    assert [c.request.request_id for c in executor.batches[0].chunks] == ["rt0", "rt1"]  # FCFS in the class


def test_one_class_alone_runs_every_iteration():
    engine, executor = make_engine()
    engine.add_request([1] * 5, SamplingParams(max_tokens=4, ignore_eos=True), "rt", priority="online")
    engine.step()
    engine.add_request([2] * 5, SamplingParams(max_tokens=3, ignore_eos=True), "be", priority="offline")
    run(engine)
    order = ["".join(sorted(classes(b))) for b in executor.batches]
    # rt alone, then turns while both have work, then rt alone again once be is done.
    assert order == ["online", "offline", "online", "offline", "online", "offline", "online"]


def test_rt_arrival_waits_one_be_iteration_at_most():
    engine, executor = make_engine(num_blocks=64, budget=16, max_seqs=8)
    for i in range(4):
        engine.add_request([3] * 12, SamplingParams(max_tokens=20, ignore_eos=True), f"be{i}", priority="offline")
    for _ in range(4):
        engine.step()
    engine.add_request([1] * 6, SamplingParams(max_tokens=3, ignore_eos=True), "rt", priority="online")
    steps_before = len(executor.batches)
    while not any(c.request.request_id == "rt" for c in executor.batches[-1].chunks):
        engine.step()
    assert len(executor.batches) - steps_before <= 2  # its class's next turn
    run(engine)


def test_chunked_prefill_within_the_token_budget():
    engine, executor = make_engine(budget=8)
    engine.add_request([1] * 20, SamplingParams(max_tokens=2, ignore_eos=True), "long", priority="online")
    engine.add_request([2] * 3, SamplingParams(max_tokens=2, ignore_eos=True), "be", priority="offline")
    engine.step()
    assert [(c.request.request_id, c.num_tokens) for c in executor.batches[-1].chunks] == [("long", 8)]
    engine.step()  # BE's turn, though "long" is mid-prompt
    assert [(c.request.request_id, c.num_tokens) for c in executor.batches[-1].chunks] == [("be", 3)]
    engine.step()
    assert [(c.request.request_id, c.num_tokens) for c in executor.batches[-1].chunks] == [("long", 8)]
    outputs = run(engine)
    assert all(len(o.token_ids) == 2 for o in outputs.values())


def test_newest_running_request_gives_way_whatever_its_class():
    engine, executor = make_engine(num_blocks=6, budget=64, max_seqs=4)
    engine.add_request([1] * 8, SamplingParams(max_tokens=12, ignore_eos=True), "rt-old", priority="online")
    engine.step()
    engine.add_request([2] * 8, SamplingParams(max_tokens=12, ignore_eos=True), "be-new", priority="offline")
    engine.step()
    assert engine.kv.num_used_blocks == 4  # 2 blocks each: 2 more to go before either is done
    outputs = run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert outputs["rt-old"].metrics.num_preemptions == 0  # the older request always advances
    assert outputs["be-new"].metrics.num_preemptions > 0
    for out in outputs.values():  # recompute resumes exactly (the executor samples position % 100)
        assert out.token_ids == [p % 100 for p in range(8, 20)]
    assert engine.kv.num_used_blocks == 0


class RoundRobinMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine, self.executor = make_engine(num_blocks=10, budget=12, max_seqs=3)
        self.sched: RoundRobinScheduler = self.engine.scheduler
        self.next_id = 0
        self.finished: set[str] = set()
        self.last = None  # (turn before the step, whether that class had running requests, batch)

    @rule(prompt_len=st.integers(1, 20), max_tokens=st.integers(1, 12), priority=st.sampled_from(["online", "offline"]))
    def add(self, prompt_len, max_tokens, priority):
        rid = f"r{self.next_id}"
        self.next_id += 1
        max_tokens = min(max_tokens, self.engine.config.max_model_len - prompt_len)
        self.engine.add_request([1 + self.next_id] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                rid, priority=priority)

    @precondition(lambda self: self.engine.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.engine.requests)))
        assert self.engine.abort_request(rid).finish_reason == "abort"
        self.finished.add(rid)

    @rule()
    def step(self):
        turn = self.sched.turn
        turn_running = any(r.priority == turn for r in self.sched.running)
        before = len(self.executor.batches)
        for out in self.engine.step():
            assert out.request_id not in self.finished, "a finished request produced output"
            if out.finished:
                self.finished.add(out.request_id)
        batch = self.executor.batches[-1] if len(self.executor.batches) > before else None
        self.last = (turn, turn_running, batch)

    @invariant()
    def one_class_per_iteration_in_turns(self):
        if self.last is None or self.last[2] is None or not self.last[2].chunks:
            return
        turn, turn_running, batch = self.last
        served = classes(batch)
        assert served == {self.sched.served_class}, "an iteration mixed the classes"
        assert self.sched.turn != self.sched.served_class  # the other class goes next
        if self.sched.served_class != turn and turn_running:
            # A class with running requests loses its turn only when its requests gave way.
            assert batch.preempted

    @invariant()
    def queues_are_consistent(self):
        sched = self.sched
        running, waiting = set(map(id, sched.running)), set(map(id, sched.waiting))
        assert not running & waiting
        assert len(running) + len(waiting) == len(self.engine.requests)
        assert len(sched.running) <= sched.config.max_num_seqs
        for cls, queue in sched.queues.items():  # each class queue is `waiting`'s order, filtered
            assert list(queue) == [r for r in sched.waiting if r.priority == cls]
        assert all(r.status == RequestStatus.RUNNING for r in sched.running)
        assert all(r.status == RequestStatus.WAITING for r in sched.waiting)

    @invariant()
    def kv_is_owned_only_by_running_requests(self):
        pool = self.engine.kv.pool
        pool.check_invariants()
        for r in self.sched.running:
            assert len(pool.block_table(r.request_id)) * pool.block_size >= r.num_computed_tokens
        for r in self.sched.waiting:  # never admitted, or preempted by recompute
            assert not pool.has(r.request_id) and r.num_computed_tokens == 0
        for rid in self.finished:
            assert not pool.has(rid)

    @invariant()
    def batch_respects_limits(self):
        if self.last is None or self.last[2] is None:
            return
        batch = self.last[2]
        assert 0 < batch.num_tokens <= self.engine.config.max_num_batched_tokens
        ids = [c.request.request_id for c in batch.chunks]
        assert len(ids) == len(set(ids)) and len(ids) <= self.engine.config.max_num_seqs

    def teardown(self):
        run(self.engine)
        assert self.engine.kv.num_used_blocks == 0


TestRoundRobinMachine = RoundRobinMachine.TestCase
TestRoundRobinMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
