"""Asynchronous scheduling (vLLM v1's; `SchedulerConfig.async_scheduling`, engine.py): step n+1 is
scheduled and launched before step n's tokens reach the host, and a request decoding in both
takes its input in n+1 from what n draws on the device.

Model-free first: a two-deep pipeline stands in for the runner. It runs each step's K/V writes
and checks at submission (`kv_harness.TaggingExecutor`), keeps the tokens it drew until
`collect` (the host does not know them before), and feeds a chunk whose last input is still in
flight from its own draws, as the runner does on the device. A request's next token is a
function of all its tokens so far, and some tokens are stop tokens, so requests end where the
scheduler cannot foresee: any lost, duplicated, misfed or reordered token changes every later
one. Then the real runner on a tiny Llama, eager and through the CUDA-graph buffers.
"""
from __future__ import annotations

import random
from collections import deque

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import initialize, invariant, rule
from kv_harness import HEAD_DIM, HEADS, LAYERS, TaggingExecutor
from test_async_pipeline import InFlightPreemptions, StepsInFlightRules, next_token
from test_async_pipeline import run as serve
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.builder import build_engine
from nanoserve.config import EngineArgs, SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.executor import Executor, ExecutorOutput
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.host import HostKVStore
from nanoserve.model.runner import ModelRunner
from nanoserve.sched import SchedulerOutput, make_scheduler

BLOCK = 4
STOP = frozenset({5, 13, 41, 77})  # about one token in 24 ends its request


class FeedingPipeline(Executor):
    """A two-deep `MicrobatchPipeline` that draws at submission and tells the host at `collect`."""

    depth = 2
    clocked = False

    def __init__(self, num_blocks: int):
        store = HostKVStore(0, BLOCK, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
        self.tagger = TaggingExecutor(store, num_blocks, BLOCK)
        self.results: deque[ExecutorOutput] = deque()
        self.drawn: dict[str, deque[int]] = {}  # per request: tokens drawn, not yet collected
        self.fed = 0  # chunks whose last input was a token still in flight

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:  # the synchronous engine's path
        self.submit(batch, counted=False)
        return self.collect()

    def submit(self, batch: SchedulerOutput, counted: bool = True) -> None:
        """`counted`: the engine has counted this step's draws as pending (its pipelined step)."""
        self.tagger.execute(batch)
        out = ExecutorOutput()
        for c in batch.chunks:
            request = c.request
            drawn = self.drawn.setdefault(request.request_id, deque())
            assert request.num_pending_tokens == len(drawn) + (counted and c.samples)
            assert c.end <= request.num_tokens + len(drawn)  # no position past the tokens drawn
            if c.end > request.num_tokens:
                assert c.end - 1 >= c.start and c.end == request.num_tokens + len(drawn)  # the latest draw
                self.fed += 1
            if c.samples:
                token = next_token((request.token_ids + list(drawn))[:c.end])
                drawn.append(token)
                out.sampled[request.request_id] = token
        self.results.append(out)

    def collect(self) -> ExecutorOutput:
        out = self.results.popleft()
        for rid in out.sampled:
            self.drawn[rid].popleft()
        return out


def make_engine(asynchronous=True, num_blocks=16, budget=8, max_seqs=6, max_model_len=40):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_model_len,
                             async_scheduling=asynchronous)
    pipeline = FeedingPipeline(num_blocks)
    engine = Engine(make_scheduler(config, BlockPool(num_blocks, BLOCK)), pipeline, tokenizer=None,
                    eos_token_ids=STOP, pipeline=pipeline if asynchronous else None)
    return engine, pipeline


def assert_replays(request) -> None:
    """Every token the request holds is the model's, and only its last may be a stop token
    (unless it ignores them)."""
    tokens = list(request.prompt_token_ids)
    for i, token in enumerate(request.output_token_ids):
        assert token == next_token(tokens), f"{request.request_id}: token {len(tokens)} is not the model's"
        assert (token not in STOP or request.params.ignore_eos
                or i == request.num_output_tokens - 1), f"{request.request_id} ran past a stop"
        tokens.append(token)


def run(engine, prompts, max_tokens):
    return serve(engine, prompts, max_tokens, ignore_eos=False)  # the stop tokens end requests


@pytest.mark.parametrize("seed", range(6))
def test_outputs_equal_synchronous_ones(seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 60) for _ in range(rng.randint(1, 15))] for _ in range(10)]
    max_tokens = [rng.randint(1, 20) for _ in prompts]
    sync, _ = make_engine(asynchronous=False)
    expected = run(sync, prompts, max_tokens)
    engine, pipeline = make_engine()
    assert run(engine, prompts, max_tokens) == expected
    assert pipeline.fed > 0  # decodes ran before their inputs reached the host
    assert engine.kv.num_used_blocks == 0


def test_decodes_are_not_held_back_and_stop_at_max_tokens():
    """With room for all, every step after the prompts' carries every request, though each one's
    last token is still in flight; none computes a position past `max_tokens`."""
    engine, pipeline = make_engine(budget=64, num_blocks=64, max_model_len=64)
    for i in range(4):
        engine.add_request([50 + i] * 3, SamplingParams(max_tokens=9, ignore_eos=True), f"r{i}")
    sizes = []
    submit = pipeline.submit
    pipeline.submit = lambda batch: (sizes.append(len(batch.chunks)), submit(batch))[1]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert sizes == [4] * 9  # one prompt step, then 8 decodes each holding all 4
    assert pipeline.fed == 4 * 8
    assert all(len(o.token_ids) == 9 and o.finish_reason == "length" for o in outputs.values())


def test_a_stop_token_in_flight_costs_one_discarded_position():
    """A request whose token stops it is already in the next step: that step's token is dropped,
    and the request's blocks go back to the pool."""
    engine, pipeline = make_engine()
    prompt = next(p for p in ([k, k + 1] for k in range(1, 60)) if next_token(p) in STOP)  # stops at once
    engine.add_request(prompt, SamplingParams(max_tokens=10), "stops")
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True), "runs")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert pipeline.fed == 1 + 3  # "stops" once (its position past the stop), "runs" for tokens 2-4
    assert finished["stops"].token_ids == [next_token(prompt)] and finished["stops"].finish_reason == "stop"
    assert len(finished["runs"].token_ids) == 4
    assert engine.kv.num_used_blocks == 0 and not any(pipeline.drawn.values())


def test_preempted_requests_with_a_token_in_flight_wait_for_it():
    """A small pool preempts running requests whose token is in flight: each must land that
    token before it recomputes (a recompute reads every token from the host)."""
    preempted_in_flight = 0
    for seed in range(30):
        rng = random.Random(seed)
        engine, _ = make_engine(num_blocks=8, budget=6, max_seqs=4)
        spy = InFlightPreemptions(engine)
        prompts = [[rng.randrange(1, 60) for _ in range(rng.randint(1, 14))] for _ in range(6)]
        sync, _ = make_engine(asynchronous=False, num_blocks=8, budget=6, max_seqs=4)
        max_tokens = [rng.randint(1, 8) for _ in prompts]
        assert run(engine, prompts, max_tokens) == run(sync, prompts, max_tokens)
        assert engine.kv.num_used_blocks == 0
        preempted_in_flight += spy.count
    assert preempted_in_flight > 0


class AsyncSchedulingMachine(StepsInFlightRules):
    """Arrivals, aborts and steps in any order over a pool small enough to preempt: after every
    step the pool is consistent, no request computes past its tokens in flight, and every token
    a request holds is the model's."""

    @initialize()
    def start(self):
        self.engine, self.pipeline = make_engine(num_blocks=8, budget=6, max_seqs=4)
        self.next_id = 0

    @rule(prompt_len=st.integers(1, 14), max_tokens=st.integers(1, 10), ignore_eos=st.booleans())
    def add(self, prompt_len, max_tokens, ignore_eos):
        self.next_id += 1
        self.engine.add_request([(self.next_id * 7 + j) % 60 + 1 for j in range(prompt_len)],
                                SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), f"r{self.next_id}")

    @invariant()
    def consistent(self):
        engine = self.engine
        engine.kv.check_invariants()
        assert len(engine._in_flight) <= 2
        for request in engine.requests.values():
            assert 0 <= request.num_pending_tokens <= 2
            assert request.num_computed_tokens <= request.num_tokens + request.num_pending_tokens
            assert request.num_output_tokens + request.num_pending_tokens <= request.params.max_tokens
            assert_replays(request)

    def teardown(self):
        super().teardown()
        assert not any(self.pipeline.drawn.values())


TestAsyncSchedulingMachine = AsyncSchedulingMachine.TestCase
TestAsyncSchedulingMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# -- the real runner -------------------------------------------------------------------------
def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 500, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("graph_buffers", [False, True])
def test_runner_feeds_tokens_in_flight_and_keeps_greedy_output(tiny_llama_dir, graph_buffers, monkeypatch):
    """Greedy output with asynchronous scheduling equals the synchronous engine's (near-ties
    aside: batches differ, one step's worth, where a request ended), eager and through the
    CUDA-graph static buffers (on a CPU: the same path without recording)."""
    extra = {"decode_graph_sizes": (1, 2, 4, 8)} if graph_buffers else {}
    params = [SamplingParams(temperature=0, max_tokens=4 + i % 9, logprobs=3, stop_token_ids=[7, 11, 13],
                             ignore_eos=True) for i in range(11)]
    sync = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4, **extra)
    refs = sync.generate(prompts(11), params, use_tqdm=False)
    fed = []
    feed = ModelRunner._feed
    monkeypatch.setattr(ModelRunner, "_feed",
                        lambda runner, ids, rows, sources: (fed.append(len(rows)), feed(runner, ids, rows, sources))[1])
    asynchronous = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4,
                       async_scheduling=True, **extra)
    outs = asynchronous.generate(prompts(11), params, use_tqdm=False)
    for ref, out, p in zip(refs, outs, params):
        assert_close_greedy(ref, out, f"request {out.request_id}", max_tokens=p.max_tokens)
        assert out.finish_reason == ref.finish_reason or out.token_ids != ref.token_ids
    assert sum(fed) > 0
    runner = asynchronous.engine.executor
    assert not runner._drawing and not runner._launched
    assert asynchronous.engine.stats().kv_blocks_used == 0
    if graph_buffers:
        assert runner.graphs.num_replays > 0


def test_seeded_sampling_draws_the_same_tokens(tiny_llama_dir):
    """A seeded request draws from its own generator, one draw per position, in order: the
    same tokens whether its inputs came from the host or the device."""
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=10, seed=100 + i, ignore_eos=True) for i in range(5)]
    sync = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4)
    asynchronous = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4, async_scheduling=True)
    refs = sync.generate(prompts(5), params, use_tqdm=False)
    outs = asynchronous.generate(prompts(5), params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]


def test_penalties_count_the_token_in_flight(tiny_llama_dir):
    """The penalties and min_tokens read a request's latest token while it is still on the device
    (`RowHistory.pending`): penalized and seeded outputs equal the synchronous engine's."""
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=7 + i, max_tokens=12, ignore_eos=True,
                             repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.4, min_tokens=3)
              for i in range(5)]
    sync = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4)
    asynchronous = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4, async_scheduling=True)
    refs = sync.generate(prompts(5), params, use_tqdm=False)
    outs = asynchronous.generate(prompts(5), params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    # min_tokens counts the token in flight: a stop token made certain stops right after it.
    stop = SamplingParams(temperature=0, max_tokens=12, min_tokens=3, stop_token_ids=[9], logit_bias={9: 100.0})
    assert [len(o.token_ids) for o in asynchronous.generate(prompts(5), stop, use_tqdm=False)] == [4] * 5


def test_a_failed_step_leaves_nothing_in_flight(tiny_llama_dir, monkeypatch):
    """A step that raises (the server then aborts every request, `AsyncEngine._fail_all`) leaves
    no step in flight and no token pending: the next requests are served as if none had failed."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4)
    refs = reference.generate(prompts(4), params, use_tqdm=False)
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4, async_scheduling=True)
    engine, runner = llm.engine, llm.engine.executor
    for p in prompts(3):
        engine.add_request(p, params)
    engine.step()
    engine.step()  # two steps in flight, then a launch fails
    monkeypatch.setattr(runner, "launch", lambda batch: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    monkeypatch.undo()
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    assert not engine.has_unfinished_requests() and not runner._launched and not runner._drawing
    assert engine.stats().kv_blocks_used == 0
    outs = llm.generate(prompts(4), params, use_tqdm=False)
    for ref, out in zip(refs, outs):
        assert_close_greedy(ref, out, f"request {out.request_id}", max_tokens=8)


@pytest.mark.parametrize("args, match", [
    (dict(policy="bros"), "cannot schedule asynchronously"),
    (dict(kv_manager="swap"), "host copies"),
    (dict(async_pipeline=True, pipeline_parallel_size=2), "one device"),
])
def test_refused_where_a_step_in_flight_could_be_overtaken(tiny_llama_dir, args, match):
    with pytest.raises(ValueError, match=match):
        build_engine(EngineArgs(str(tiny_llama_dir), device="cpu", kv_cache_tokens=256, async_scheduling=True, **args))


def test_scheduler_config_refuses_both_kinds_of_steps_in_flight():
    with pytest.raises(ValueError, match="async_scheduling"):
        SchedulerConfig(async_scheduling=True, microbatches_in_flight=2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_output_on_the_gpu(tiny_llama_dir, graphs):
    """On a GPU the host really runs ahead: step n+1's inputs are fed on the device from step
    n's draws before the host has read them. Greedy output stays the synchronous engine's."""
    extra = {} if graphs else {"enforce_eager": True}
    params = [SamplingParams(temperature=0, max_tokens=6 + i % 9, logprobs=2, stop_token_ids=[7, 11, 13],
                             ignore_eos=True) for i in range(13)]
    sync = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", kv_cache_tokens=4096, max_num_seqs=16, **extra)
    refs = sync.generate(prompts(13), params, use_tqdm=False)
    asynchronous = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", kv_cache_tokens=4096, max_num_seqs=16,
                       async_scheduling=True, **extra)
    outs = asynchronous.generate(prompts(13), params, use_tqdm=False)
    for ref, out, p in zip(refs, outs, params):
        assert_close_greedy(ref, out, f"request {out.request_id}", max_tokens=p.max_tokens)
    runner = asynchronous.engine.executor
    assert not runner._drawing and asynchronous.engine.stats().kv_blocks_used == 0
    if graphs:
        assert runner.graphs.num_replays > 0
