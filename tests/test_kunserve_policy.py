"""KunServe's lookahead batch formulation (kunserve.txt §4.3): cost-balanced micro-batches beat
token-count chunking on a skewed queue, always cover the queued work exactly, and the policy
built on them gives FCFS's answers."""
from __future__ import annotations

import math
import random
import statistics

import pytest
import torch
from conftest import build_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_harness import HEAD_DIM, HEADS, LAYERS, TaggingExecutor
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.host import HostKVStore
from nanoserve.request import Request
from nanoserve.sched import make_scheduler
from nanoserve.sched.cost_model import DEFAULT_COST_MODEL, CostModel
from nanoserve.sched.kunserve import (
    KunServeScheduler,
    bubble_ratio,
    lookahead_microbatches,
    microbatch_cost,
    pipeline_time,
    token_count_microbatches,
)

# One long prompt resuming over a long prefix, then many short prompts (a burst, §4.3).
SKEWED = [("long", 4000, 1024)] + [(f"short-{i}", 0, 32) for i in range(32)]


def costs_of(microbatches, cost_model=DEFAULT_COST_MODEL):
    return [microbatch_cost(b, cost_model) for b in microbatches]


def cv(costs):
    return statistics.pstdev(costs) / statistics.mean(costs)


@pytest.mark.parametrize("min_tokens", [64, 128, 256])
def test_lookahead_balances_cost_where_token_counts_do_not(min_tokens):
    lookahead = lookahead_microbatches(SKEWED, DEFAULT_COST_MODEL, min_tokens)
    total = sum(n for _, _, n in SKEWED)
    # The baseline with as many micro-batches (Sarathi-Serve's equal token counts, Fig. 17 (a)).
    baseline = token_count_microbatches(SKEWED, math.ceil(total / len(lookahead)))
    assert len(baseline) == len(lookahead) > 1
    la, tc = costs_of(lookahead), costs_of(baseline)
    assert max(la) / min(la) < 1.2 < 2.0 < max(tc) / min(tc)
    assert cv(la) < 0.05 < 0.3 < cv(tc)
    for stages in (2, 4):
        for lockstep in (False, True):
            assert bubble_ratio(la, stages, lockstep) < bubble_ratio(tc, stages, lockstep)
    # The long request's pieces (a late, prefix-heavy chunk costs more per token) hold fewer
    # tokens than the short requests' micro-batches, and it was cut where a balance fell in it.
    long_tokens = [sum(n for rid, _, n in b) for b in lookahead if all(rid == "long" for rid, _, _ in b)]
    short_tokens = [sum(n for _, _, n in b) for b in lookahead if all(rid != "long" for rid, _, _ in b)]
    assert long_tokens and short_tokens and max(long_tokens) < min(short_tokens)


def test_pipeline_time_is_eq4_for_two_lockstep_stages():
    costs = [3.0, 1.0, 1.0, 3.0]
    eq4 = costs[0] + sum(max(a, b) for a, b in zip(costs, costs[1:])) + costs[-1]
    assert pipeline_time(costs, 2, lockstep=True) == pytest.approx(eq4 / 2)
    assert pipeline_time(costs, 2) <= pipeline_time(costs, 2, lockstep=True)
    # Equal micro-batches leave only the fill-and-drain bubble, (S - 1) / (m + S - 1).
    for stages, m in [(2, 4), (4, 8), (3, 1)]:
        assert bubble_ratio([1.0] * m, stages) == pytest.approx((stages - 1) / (m + stages - 1))
    assert bubble_ratio([2.0, 5.0], 1) == 0.0 and bubble_ratio([], 2) == 0.0


COST_MODELS = st.sampled_from([
    DEFAULT_COST_MODEL,
    CostModel(prefill_attn=1e-6),  # attention only: strongly quadratic
    CostModel(prefill_tokens=1.0),  # linear: lookahead degenerates to token counts
    CostModel(prefill_attn=1e-6, prefill_chunks=1e-2, decode_context=1e-4, decode_seqs=1e-2, iteration=1.0),
])
WORK = st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 400)), min_size=0, max_size=24)


@settings(max_examples=300, deadline=None)
@given(work=WORK, min_tokens=st.integers(1, 300), cost_model=COST_MODELS)
def test_microbatches_cover_the_queue_exactly_once_in_order(work, min_tokens, cost_model):
    work = [(f"r{i}", start, n) for i, (start, n) in enumerate(work)]
    microbatches = lookahead_microbatches(work, cost_model, min_tokens)
    total = sum(n for _, _, n in work)
    assert (not microbatches) == (not work)
    # Concatenated, the micro-batches are the queue, each request's tokens in order.
    flat = [piece for b in microbatches for piece in b]
    assert all(b for b in microbatches) and all(n >= 1 for _, _, n in flat)
    expected_next = {rid: start for rid, start, _ in work}
    order = []
    for rid, start, n in flat:
        assert start == expected_next[rid], f"{rid} is not contiguous"
        expected_next[rid] = start + n
        if not order or order[-1] != rid:
            order.append(rid)
    assert expected_next == {rid: start + n for rid, start, n in work}, "a token is missing"
    assert order == [rid for rid, _, _ in work], "requests out of queue order"
    # At least MIN tokens per micro-batch, except when the whole queue is under MIN.
    sizes = [sum(n for _, _, n in b) for b in microbatches]
    if total >= min_tokens:
        assert min(sizes) >= min_tokens
    else:
        assert len(microbatches) <= 1
    assert len(microbatches) <= max(1, total // min_tokens)


@given(work=WORK, tokens=st.integers(1, 300))
def test_token_count_microbatches_cover_the_queue(work, tokens):
    work = [(f"r{i}", start, n) for i, (start, n) in enumerate(work)]
    microbatches = token_count_microbatches(work, tokens)
    sizes = [sum(n for _, _, n in b) for b in microbatches]
    assert all(s == tokens for s in sizes[:-1]) and sum(sizes) == sum(n for _, _, n in work)


class CheckingExecutor(TaggingExecutor):
    """Checks every step against the lookahead the scheduler has just formed for it."""

    def __init__(self, store, num_blocks, block_size, scheduler):
        super().__init__(store, num_blocks, block_size)
        self.scheduler, self.steps = scheduler, 0

    def execute(self, batch):
        config, first = self.scheduler.config, self.scheduler.last_microbatches[0]
        chunks = [(c.request.request_id, c.start, c.num_tokens) for c in batch.chunks]
        if sum(n for _, _, n in first) <= config.max_num_batched_tokens and not batch.preempted:
            assert chunks == first  # the whole first micro-batch, nothing else
        assert batch.num_tokens <= config.max_num_batched_tokens and len(chunks) <= config.max_num_seqs
        assert 0.0 <= self.scheduler.last_bubble_ratio < 1.0
        self.steps += 1
        return super().execute(batch)


def test_each_step_runs_the_first_lookahead_microbatch():
    store = HostKVStore(0, 4, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256, policy="kunserve")
    scheduler = make_scheduler(config, BlockPool(64, 4))
    assert isinstance(scheduler, KunServeScheduler) and scheduler.min_tokens == 16
    executor = CheckingExecutor(store, 64, 4, scheduler)
    engine = Engine(scheduler, executor, tokenizer=None)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add_request([1] * 90, params, "long")
    for i in range(6):
        engine.add_request([2 + i] * 9, params, f"short-{i}")
    finished = set()
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert len(finished) == 7 and executor.steps == scheduler.stats["steps"]
    assert scheduler.stats["request_cuts"] > 0 and engine.kv.num_used_blocks == 0


def test_kunserve_gives_fcfs_answers(tmp_path):
    build_tiny_model("llama", tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (70, 9, 41, 5, 23, 55, 12)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    reference = LLM(str(tmp_path), device="cpu", kv_cache_tokens=2048, block_size=4)
    expected = reference.generate(prompts, params, use_tqdm=False)
    for label, kwargs in [("chunked", dict(kv_cache_tokens=2048)), ("preempted", dict(kv_cache_tokens=96))]:
        llm = LLM(str(tmp_path), device="cpu", policy="kunserve", block_size=4, max_num_batched_tokens=16,
                  **kwargs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scheduler = llm.engine.scheduler
        assert scheduler.stats["request_cuts"] > 0, "the prompts were meant to be chunked"
        if label == "preempted":
            assert llm.engine.stats().num_preemptions > 0
        for i, (ref, out) in enumerate(zip(expected, outputs)):
            assert_close_greedy(ref, out, f"{label}: prompt {i}", max_tokens=10)


def test_a_pipelined_step_is_cut_into_microbatches_of_equal_cost():
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=256, policy="kunserve",
                             pipeline_microbatches=2)
    scheduler = make_scheduler(config, BlockPool(256, 4))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for i, n in enumerate((40, 9, 30, 5)):
        scheduler.add_request(Request(f"r{i}", [1 + i] * n, params))
    cut_steps = two_way = 0
    for _ in range(40):
        out = scheduler.schedule()
        if not out.chunks:
            break
        if out.microbatches is not None:
            cut_steps += 1
            # Fig. 11 lines 4-5: no micro-batch under MIN (budget / m = 16) tokens, so fewer cuts
            # for a small step (a decode step is not cut at all).
            assert len(out.microbatches) == max(1, min(2, out.num_tokens // 16))
            assert len(out.microbatches) == 1 or all(sum(p.num_tokens for p in mb) >= 16 for mb in out.microbatches)
            if len(out.microbatches) == 2:  # the balance point: no token moved across is better
                two_way += 1
                costs = [microbatch_cost([(p.request.request_id, p.start, p.num_tokens) for p in mb],
                                         scheduler.cost_model) for mb in out.microbatches]
                assert abs(costs[0] - costs[1]) <= max(scheduler.cost_model.chunk_cost(0, 64), 1e-9)
            # The micro-batches are the chunks, cut: each request's pieces in order, none lost.
            for chunk in out.chunks:
                pieces = [p for mb in out.microbatches for p in mb if p.request is chunk.request]
                assert pieces[0].start == chunk.start and pieces[-1].end == chunk.end
                assert all(a.end == b.start for a, b in zip(pieces, pieces[1:]))
        scheduler.update_after_step(out)
        for chunk in out.chunks:  # "sample" so decodes follow
            if chunk.samples:
                chunk.request.append_token(7, 0.0)
    assert cut_steps > 0 and two_way > 0


def test_a_pipelined_member_looks_ahead_m_budgets_into_the_queue():
    """§4.3 (issue 46): a cluster member in a group looks ahead over the running and waiting
    requests, m token budgets deep, and cuts that into at most m cost-balanced micro-batches;
    the engine's own PP (no `step_tokens`) keeps FCFS's one budget, re-cut."""
    def scheduled(step_tokens, options=None):
        config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=16, max_model_len=256, policy="kunserve",
                                 policy_options=options or {})
        scheduler = make_scheduler(config, BlockPool(256, 4))
        scheduler.use_pipeline(2, 4, step_tokens)
        for i in range(10):
            scheduler.add_request(Request(f"r{i}", [1 + i] * 20, SamplingParams(max_tokens=4)))
        out = scheduler.schedule()
        assert len(out.microbatches) <= 4
        pieces: dict[str, int] = {}
        for mb in out.microbatches:  # the cut covers the step's chunks exactly (a request may be cut)
            for c in mb:
                pieces[c.request.request_id] = pieces.get(c.request.request_id, 0) + c.num_tokens
        assert pieces == {c.request.request_id: c.num_tokens for c in out.chunks}
        return out.num_tokens, len(out.microbatches)

    assert scheduled(4 * 32) == (128, 4)  # six requests and a piece of the seventh, four micro-batches of 32
    assert scheduled(None)[0] == 32  # FCFS's step, re-cut
    assert scheduled(4 * 32, {"pipeline_step_tokens": 32})[0] == 32  # the option wins: the ablation
    # Fig. 17 (a)'s baseline on the same work: the same 128 tokens, cut by token count into 32s.
    assert scheduled(4 * 32, {"pipeline_cut": "tokens"}) == (128, 4)
    with pytest.raises(ValueError, match="pipeline_cut"):
        scheduled(4 * 32, {"pipeline_cut": "random"})
