"""The engine's asynchronous pipeline (engine.py `_pipelined_step`, `Scheduler.update_after_submit`):
steps submitted while earlier ones are still in flight, results collected in order.

A model-free pipeline stands in for the stages. It runs each step's K/V writes and checks when
the step is submitted (`kv_harness.TaggingExecutor`: every position a chunk reads must hold the
K/V written for it; each stage runs micro-batches in submission order, so that is when a real
stage's layer would), and hands the sampled tokens back only at `collect`. A request's next
token is a function of all its tokens so far, so a lost, duplicated or reordered token changes
every token after it: each output is checked against that function replayed from the prompt.
"""
from __future__ import annotations

import random
from collections import deque

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kv_harness import HEAD_DIM, HEADS, LAYERS, TaggingExecutor

from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.executor import Executor, ExecutorOutput
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.host import HostKVStore
from nanoserve.sampling import SamplingParams
from nanoserve.sched import SchedulerOutput, make_scheduler

BLOCK = 4


def next_token(tokens) -> int:
    """The stand-in model: the next token depends on every token before it."""
    return 1 + (sum((i + 1) * t for i, t in enumerate(tokens)) * 2654435761) % 97


class TaggingPipeline(Executor):
    """A `MicrobatchPipeline` of `depth` whose stages are a TaggingExecutor run at submission."""

    def __init__(self, num_blocks: int, depth: int):
        store = HostKVStore(0, BLOCK, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
        self.tagger = TaggingExecutor(store, num_blocks, BLOCK)
        self.depth = depth
        self.clocked = False
        self.results: deque[ExecutorOutput] = deque()
        self.max_in_flight = 0
        self.chunks_behind_their_own = 0  # a prompt's chunk submitted while its previous one was in flight
        self._in_flight_ids: deque[set[str]] = deque()

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:  # the synchronous engine's path
        self.submit(batch)
        return self.collect()

    def submit(self, batch: SchedulerOutput) -> None:
        self.tagger.execute(batch)
        for c in batch.chunks:
            assert c.end <= c.request.num_tokens  # every token it computes is known
            self.chunks_behind_their_own += any(c.request.request_id in ids for ids in self._in_flight_ids)
        self._in_flight_ids.append({c.request.request_id for c in batch.chunks})
        self.results.append(ExecutorOutput(sampled={c.request.request_id: next_token(c.request.token_ids[:c.end])
                                                    for c in batch.chunks if c.samples}))
        self.max_in_flight = max(self.max_in_flight, len(self.results))

    def collect(self) -> ExecutorOutput:
        self._in_flight_ids.popleft()
        return self.results.popleft()


def make_engine(policy="fcfs", num_blocks=12, depth=2, budget=8, max_seqs=6, asynchronous=True):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=40, policy=policy,
                             microbatches_in_flight=depth if asynchronous else 1)
    pipeline = TaggingPipeline(num_blocks, depth)
    engine = Engine(make_scheduler(config, BlockPool(num_blocks, BLOCK)), pipeline, tokenizer=None,
                    pipeline=pipeline if asynchronous else None)
    return engine, pipeline


def assert_replays(request) -> None:
    tokens = list(request.prompt_token_ids)
    for token in request.output_token_ids:
        assert token == next_token(tokens), f"{request.request_id}: token {len(tokens)} is not the model's"
        tokens.append(token)


def run(engine, prompts, max_tokens, ignore_eos=True):
    """Serve the prompts to the end: each finished request's (token ids, finish reason)."""
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=ignore_eos), f"r{i}")
    outputs = {}
    for _ in range(3_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = (out.token_ids, out.finish_reason)
    assert not engine.has_unfinished_requests()
    return outputs


@pytest.mark.parametrize("policy", ["fcfs", "kunserve"])
@pytest.mark.parametrize("depth", [2, 3])
def test_in_flight_outputs_equal_synchronous_ones(policy, depth):
    prompts = [[(7 * i + j) % 50 + 1 for j in range(3 + 5 * i % 17)] for i in range(9)]
    max_tokens = [1 + (3 * i) % 7 for i in range(9)]
    sync, _ = make_engine(policy, depth=depth, asynchronous=False)
    expected = run(sync, prompts, max_tokens)
    engine, pipeline = make_engine(policy, depth=depth)
    assert run(engine, prompts, max_tokens) == expected
    for request in engine.requests.values():
        assert_replays(request)
    assert pipeline.max_in_flight == depth
    assert pipeline.chunks_behind_their_own > 0  # prompts' chunks followed each other through the pipeline
    assert engine.kv.num_used_blocks == 0
    assert all(r.num_pending_tokens == 0 for r in engine.requests.values())


def test_each_step_takes_its_share_of_the_decodes():
    engine, pipeline = make_engine(depth=2, budget=64, max_seqs=8, num_blocks=32)
    for i in range(8):
        engine.add_request([i + 1] * 3, SamplingParams(max_tokens=6, ignore_eos=True), f"r{i}")
    sizes = []
    submit = pipeline.submit
    pipeline.submit = lambda batch: (sizes.append(len(batch.chunks)), submit(batch))[1]
    while engine.has_unfinished_requests():
        engine.step()
    # The prompts all fit the first step's budget; from then on each step decodes half of them.
    # Without the share every step would take all 8 and the pipeline would carry one at a time.
    assert sizes[0] == 8 and max(sizes[1:]) == 4 and sizes.count(4) >= 8


class InFlightPreemptions:
    """Counts the preemptions (through `engine`'s scheduler) of requests with a token in flight."""

    def __init__(self, engine: Engine) -> None:
        self.count = 0
        self._preempt = engine.scheduler.preempt
        engine.scheduler.preempt = self

    def __call__(self, request, keep_resident=False):
        self.count += request.num_pending_tokens > 0
        return self._preempt(request, keep_resident)


def test_requests_preempted_with_a_token_in_flight_wait_for_it():
    """A pool of 8 blocks for 6 requests preempts often, and with 3 steps in flight the newest
    running request (FCFS's victim) often has its token in one of them: it must not run again
    (recompute would sample the same position twice) until that token lands."""
    preempted_in_flight = 0
    for seed in range(40):
        rng = random.Random(seed)
        engine, _ = make_engine(num_blocks=8, depth=3, budget=6, max_seqs=4)
        spy = InFlightPreemptions(engine)
        prompts = [[rng.randrange(1, 60) for _ in range(rng.randint(1, 14))] for _ in range(6)]
        outputs = run(engine, prompts, [rng.randint(1, 8) for _ in prompts])
        assert len(outputs) == 6 and engine.kv.num_used_blocks == 0
        for request in engine.requests.values():
            assert_replays(request)
        preempted_in_flight += spy.count
    assert preempted_in_flight > 0


def test_policies_that_keep_more_state_refuse_an_asynchronous_pipeline():
    config = SchedulerConfig(policy="bros", microbatches_in_flight=2)
    with pytest.raises(ValueError, match="asynchronous pipeline"):
        make_scheduler(config, BlockPool(8, BLOCK))


class StepsInFlightRules(RuleBasedStateMachine):
    """The rules an engine with steps in flight shares with its variants (test_async_scheduling):
    aborts of live requests and runs of steps, in any order among the arrivals a subclass adds;
    at the end, every request drains and the pool is empty."""

    engine: Engine

    @rule(data=st.data())
    def abort(self, data):
        live = sorted(r.request_id for r in self.engine.requests.values() if not r.is_finished)
        if live:
            self.engine.abort_request(data.draw(st.sampled_from(live)))

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.engine.step()

    def teardown(self):
        for _ in range(5_000):
            if not self.engine.has_unfinished_requests():
                break
            self.engine.step()
        assert not self.engine.has_unfinished_requests() and self.engine.kv.num_used_blocks == 0


class InFlightMachine(StepsInFlightRules):
    """Arrivals, aborts and steps in any order, with a pool small enough to preempt requests
    whose tokens are in flight; after every step the KV pool is consistent, no request waits
    for two tokens at once, and every token any request holds is the model's."""

    @initialize(depth=st.integers(2, 3))
    def start(self, depth):
        self.engine, self.pipeline = make_engine(num_blocks=8, depth=depth, budget=6, max_seqs=4)
        self.next_id = 0

    @rule(prompt_len=st.integers(1, 14), max_tokens=st.integers(1, 8))
    def add(self, prompt_len, max_tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.engine.add_request([(self.next_id * 5 + j) % 60 + 1 for j in range(prompt_len)],
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid)

    @invariant()
    def consistent(self):
        engine = self.engine
        engine.kv.check_invariants()
        in_flight = [c.request.request_id for batch in engine._in_flight for c in batch.chunks if c.samples]
        assert len(in_flight) == len(set(in_flight)), "a request samples in two steps in flight"
        for batch in engine._in_flight:
            for c in batch.chunks:
                assert c.request.num_pending_tokens == (c.request.request_id in in_flight)
        assert len(engine._in_flight) <= self.pipeline.depth
        for request in engine.requests.values():
            assert_replays(request)

    def teardown(self):
        super().teardown()
        for request in self.engine.requests.values():
            assert_replays(request)


TestInFlightMachine = InFlightMachine.TestCase
TestInFlightMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
