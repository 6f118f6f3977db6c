"""The FCFS scheduler driven through the real Engine by a model-free executor, checked by a
hypothesis state machine after every step."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.executor import Executor, ExecutorOutput
from nanoserve.memory.blocks import BlockPool
from nanoserve.request import RequestStatus
from nanoserve.sampling import SamplingParams
from nanoserve.sched import SchedulerOutput
from nanoserve.sched.fcfs import FCFSScheduler


class EchoExecutor(Executor):
    """Samples token (position % 100) for every chunk that samples; remembers every batch."""

    def __init__(self):
        self.batches: list[SchedulerOutput] = []

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        self.batches.append(batch)
        return ExecutorOutput(sampled={c.request.request_id: c.end % 100 for c in batch.chunks if c.samples})


def make_engine(num_blocks=8, block_size=4, budget=16, max_seqs=4, max_len=32):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len)
    executor = EchoExecutor()
    engine = Engine(FCFSScheduler(config, BlockPool(num_blocks, block_size)), executor, tokenizer=None)
    return engine, executor


def run_to_completion(engine, max_steps=10_000):
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError("requests did not finish")


def test_decode_and_prefill_chunks_share_a_step():
    engine, executor = make_engine(num_blocks=32, budget=8)
    engine.add_request([1] * 3, SamplingParams(max_tokens=4, ignore_eos=True), "short")
    engine.step()  # "short" prefills and samples its first token
    engine.add_request([2] * 20, SamplingParams(max_tokens=2), "long")
    engine.step()
    chunks = {c.request.request_id: c for c in executor.batches[-1].chunks}
    assert chunks["short"].num_tokens == 1  # a decode
    assert chunks["long"].num_tokens == 7 and not chunks["long"].samples  # a prefill chunk
    outputs = run_to_completion(engine)
    assert len(outputs["long"].token_ids) == 2 and len(outputs["short"].token_ids) == 4


def test_preemption_recomputes_and_finishes_everything():
    engine, executor = make_engine(num_blocks=6, block_size=4, budget=32, max_seqs=4)
    for i in range(4):
        engine.add_request([i + 1] * 6, SamplingParams(max_tokens=10), f"r{i}")
    outputs = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    for out in outputs.values():
        # The echo executor's tokens depend only on positions: preemption must not change them.
        assert out.token_ids == [p % 100 for p in range(6, 16)]
        assert out.finish_reason == "length"
    assert engine.kv.num_used_blocks == 0


class FCFSMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine, self.executor = make_engine(num_blocks=10, block_size=4, budget=12, max_seqs=3, max_len=32)
        self.next_id = 0
        self.finished: set[str] = set()
        self.prompt_len: dict[str, int] = {}
        self.last_batch: SchedulerOutput | None = None

    def check_tokens(self, out) -> None:
        """The echo executor's token for a position is the position % 100 (the next one it
        writes): preemption and recomputation must not change a finished request's tokens."""
        if out.finish_reason != "abort":
            start = self.prompt_len[out.request_id]
            assert out.token_ids == [p % 100 for p in range(start, start + len(out.token_ids))]

    @rule(prompt_len=st.integers(1, 20), max_tokens=st.integers(1, 12))
    def add(self, prompt_len, max_tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.engine.add_request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), rid)
        self.prompt_len[rid] = prompt_len

    @precondition(lambda self: self.engine.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.engine.requests)))
        out = self.engine.abort_request(rid)
        assert out.finish_reason == "abort"
        self.finished.add(rid)

    @rule()
    def step(self):
        before = len(self.executor.batches)
        for out in self.engine.step():
            assert out.request_id not in self.finished, "a finished request produced output"
            if out.finished:
                self.finished.add(out.request_id)
                self.check_tokens(out)
        self.last_batch = self.executor.batches[-1] if len(self.executor.batches) > before else None

    @invariant()
    def pool_is_consistent(self):
        self.engine.kv.check_invariants()

    @invariant()
    def queues_are_disjoint_and_complete(self):
        sched = self.engine.scheduler
        running, waiting = set(map(id, sched.running)), set(map(id, sched.waiting))
        assert not running & waiting
        assert len(running) + len(waiting) == len(self.engine.requests)
        assert len(sched.running) <= sched.config.max_num_seqs
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
        for r in sched.waiting:
            assert r.status == RequestStatus.WAITING

    @invariant()
    def kv_is_owned_only_by_live_requests(self):
        pool, sched = self.engine.kv.pool, self.engine.scheduler
        for r in sched.running:
            assert len(pool.block_table(r.request_id)) * pool.block_size >= r.num_computed_tokens
        for r in sched.waiting:  # waiting requests were never admitted or were preempted
            assert not pool.has(r.request_id) and r.num_computed_tokens == 0
        for rid in self.finished:
            assert not pool.has(rid)

    @invariant()
    def batch_respects_limits(self):
        if self.last_batch is None:
            return
        assert 0 < self.last_batch.num_tokens <= self.engine.config.max_num_batched_tokens
        ids = [c.request.request_id for c in self.last_batch.chunks]
        assert len(ids) == len(set(ids))

    def teardown(self):
        for out in run_to_completion(self.engine).values():
            self.check_tokens(out)
        assert self.engine.kv.num_used_blocks == 0
        self.engine.kv.check_invariants()


TestFCFSMachine = FCFSMachine.TestCase
TestFCFSMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
