"""EcoServe's scheduling policy (policy="ecoserve", ecoserve.txt §3) over exact allocation.

- Behaviour, through the real Engine with a model-free executor (kv_harness.TaggingExecutor) and a
  mock clock: with correct response-length predictions (an OraclePredictor) a workload that fills
  the KV pool never has a request outgrow its reservation, so nothing is ever preempted (§3.2:
  exact allocation avoids KV allocation failures); the same workload under-predicted draws on the
  reserved pool and preempts (§3.2.2), and still produces every token.
- Selection: equal-RL groups from the generation queue fill the free KV with a bisect past a head
  that does not fit (§3.2.1, §3.3); deadline buckets come first; the TFS comes from the cost model.
- Same answers: a tiny random Llama (fp32, CPU) with a tight pool and under-predicted lengths
  gives the same greedy outputs under ecoserve as under fcfs, with hosting (§3.4), the reserved
  pool and offload-free preemption (§3.2.2) all exercised.
"""
from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory import KVBuildContext, make_kv_manager
from nanoserve.memory.host import HostKVStore
from nanoserve.request import Request
from nanoserve.sched.cost_model import CostModel
from nanoserve.sched.ecoserve import EcoServeScheduler
from nanoserve.sched.predictor import OraclePredictor
from nanoserve.slo import SLO

from conftest import build_tiny_model
from kv_harness import HEADS, HEAD_DIM, LAYERS, MockClock, TaggingExecutor
from test_invariance import assert_close_greedy

BLOCK = 4



def _exact(num_blocks: int, host_blocks: int = 0, **options):
    store = HostKVStore(host_blocks, BLOCK, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    return make_kv_manager("exact", KVBuildContext(num_blocks, BLOCK, None, store, options))  # type: ignore[arg-type]


def _engine(kv, num_blocks: int, budget: int = 32, max_seqs: int = 16, **kwargs):
    clock = MockClock()
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_model_len=kv.max_request_tokens, policy="ecoserve")
    scheduler = EcoServeScheduler(config, kv, clock=clock, **kwargs)
    executor = TaggingExecutor(kv.alloc.host_store, num_blocks, BLOCK)
    return Engine(scheduler, executor, tokenizer=None), executor, clock


# -- behaviour through the Engine ------------------------------------------------------------
def _workload(seed: int, n: int = 14):
    """(rid, prompt_len, true output length): each request stops on a stop token after exactly
    its true length (the executor samples position % 100), well before max_tokens."""
    rng = random.Random(seed)
    return [(f"r{i}", rng.randint(2, 8), rng.randint(3, 20)) for i in range(n)]


def _run(kv, num_blocks: int, workload, seed: int):
    engine, executor, clock = _engine(kv, num_blocks)
    rng = random.Random(seed)
    pending = [(rng.randint(0, 6), *w) for w in workload]  # (arrival step, rid, prompt, length)
    expected, finished, peak, concurrency = {}, {}, 0, 0
    for step in range(3_000):
        for arrival, rid, prompt_len, length in [p for p in pending if p[0] <= step]:
            pending.remove((arrival, rid, prompt_len, length))
            stop = (prompt_len + length - 1) % 100
            engine.add_request([1] * prompt_len, SamplingParams(max_tokens=32, stop_token_ids=[stop]), rid,
                               priority=rng.choice(["online", "offline"]))
            expected[rid] = [p % 100 for p in range(prompt_len, prompt_len + length)]
        if not pending and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        peak, concurrency = max(peak, kv.num_used_blocks), max(concurrency, engine.scheduler.num_running)
        clock.now += 0.05
    assert finished == expected, "a request was lost or resumed at the wrong place"
    assert kv.num_used_blocks == 0 and executor.positions_checked > 0
    return engine, peak, concurrency


@pytest.mark.parametrize("seed", range(4))
def test_correct_predictions_fill_the_pool_without_a_single_preemption(seed):
    workload = _workload(seed)
    oracle = OraclePredictor({rid: length for rid, _, length in workload})
    kv = _exact(24, predicted_len=oracle, padding_ratio=0.0, reserved_fraction=0.1)
    engine, peak, concurrency = _run(kv, 24, workload, seed)
    admission_pool = kv.num_blocks - kv.alloc.reserve_target
    assert peak >= 0.75 * admission_pool, f"the workload never filled the pool (peak {peak}/{admission_pool})"
    events = kv.events
    assert events["preemptions"] == 0 and engine.scheduler.num_preemptions == 0, events
    assert events["reserved_pool_draws"] == 0 and events["hosted_evictions"] == 0, events
    # Reserving max_tokens (no predictor) is just as safe, but runs fewer requests at once.
    _, _, without = _run(_exact(24, padding_ratio=0.0, reserved_fraction=0.1), 24, workload, seed)
    assert concurrency > without


@pytest.mark.parametrize("seed", range(4))
def test_under_predictions_draw_on_the_reserved_pool_then_preempt_and_still_finish(seed):
    workload = _workload(seed)
    kv = _exact(24, predicted_len=2, padding_ratio=0.0, reserved_fraction=0.1)
    engine, _, _ = _run(kv, 24, workload, seed)
    events = kv.events
    assert events["reserved_pool_draws"] > 0 and events["preemptions"] > 0, events
    assert engine.scheduler.num_preemptions == events["preemptions"]


@pytest.mark.parametrize("seed", range(16))
def test_hosting_and_under_prediction_keep_every_position(seed):
    # Random pools, predictions (often far too short), SLOs and budgets; one long request to host
    # the others (§3.4). The executor checks every earlier position of every chunk, so a guest
    # evicted after its chunk was planned (kv.order not respected) or a lost slot fails at once.
    rng = random.Random(seed)
    device_blocks, host_blocks = rng.choice([16, 24, 40]), rng.choice([0, 2, 64])
    lengths = {f"r{i}": rng.randint(4, 30) for i in range(10)}
    lengths["r0"] = 40
    predicted = {rid: max(1, n // rng.choice([1, 4, 8])) for rid, n in lengths.items()}
    predicted["r0"] = lengths["r0"]
    kv = _exact(device_blocks, host_blocks, predicted_len=lambda r: predicted[r.request_id],
                padding_ratio=rng.choice([0.0, 0.15]), reserved_fraction=rng.choice([0.0, 0.1, 0.2]),
                pipeline_buffer=rng.choice([0, 2]))
    engine, executor, clock = _engine(kv, device_blocks, budget=rng.choice([3, 6, 16]), max_seqs=8)
    for rid, n in lengths.items():
        engine.add_request([1] * rng.randint(1, 6), SamplingParams(max_tokens=n, ignore_eos=True), rid,
                           priority=rng.choice(["online", "offline"]),
                           slo=rng.choice([None, SLO(ttft=0.05, tpot=0.01), SLO(ttft=10.0, tpot=1.0)]))
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        engine.step()  # the engine checks the allocator's invariants every step
        clock.now += 0.02
    assert not engine.has_unfinished_requests() and executor.positions_checked > 0
    assert kv.num_used_blocks == 0 and kv.alloc.host_store.num_free_blocks == host_blocks


# -- selection and ordering (one plan at a time) ---------------------------------------------
def _scheduler(kv, budget: int = 64, max_seqs: int = 16, **kwargs):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_model_len=kv.max_request_tokens, policy="ecoserve")
    return EcoServeScheduler(config, kv, clock=MockClock(), tfs_target=None, **kwargs)


def _request(rid: str, prompt_len: int = 2, max_tokens: int = 40, **kwargs):
    return Request(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=100.0, **kwargs)


def test_equal_rl_groups_fill_the_free_kv_past_a_head_that_does_not_fit():
    rl = {"o": 22, "a": 40, "b": 14, "c": 14, "d": 6}
    # A huge pipeline buffer keeps §3.4 hosting out of this test: only the free blocks count.
    kv = _exact(16, predicted_len=lambda r: rl[r.request_id], padding_ratio=0.0, reserved_fraction=0.0,
                pipeline_buffer=1000)
    sched = _scheduler(kv)
    occupant = _request("o")
    sched.add_request(occupant)
    first = sched.schedule()
    assert [c.request.request_id for c in first.chunks] == ["o"]  # 2 + 22 tokens: 6 of 16 blocks
    sched.update_after_step(first)
    occupant.append_token(7, 100.0)
    for rid in "abcd":  # FCFS would stop at "a": 42 tokens, 11 blocks, with 10 free
        sched.add_request(_request(rid))
    out = sched.schedule()
    # o decodes; then the RL=14 group (4 blocks each) is the longest that fits, and d (2 blocks)
    # takes the rest.
    assert [c.request.request_id for c in out.chunks] == ["o", "b", "c", "d"]
    assert kv.alloc.num_free_blocks == 0 and [r.request_id for r in sched.waiting] == ["a"]


def test_deadline_buckets_come_before_occupied_kv_and_length():
    kv = _exact(16, padding_ratio=0.0, reserved_fraction=0.0)  # predictions: max_tokens
    sched = _scheduler(kv, max_seqs=1)
    sched.add_request(_request("batch", max_tokens=40, priority="offline", slo=SLO()))  # no deadline
    sched.add_request(_request("chat", max_tokens=10, slo=SLO(ttft=0.3, tpot=0.05)))  # due in 0.3 s
    assert [c.request.request_id for c in sched.schedule().chunks] == ["chat"]

    # Same deadline bucket: a preempted request (it held KV) goes before a longer new one.
    sched = _scheduler(_exact(16, padding_ratio=0.0, reserved_fraction=0.0), max_seqs=1)
    new, preempted = _request("new", max_tokens=40), _request("old", max_tokens=20)
    preempted.num_preemptions = 1
    preempted.token_ids += [5] * 200  # 200 generated tokens: two occupied-KV buckets up
    for r in (new, preempted):
        r.slo = SLO()
        sched.add_request(r)
    assert sched._gt_key(preempted, 100.0) < sched._gt_key(new, 100.0)


def test_target_forward_size_is_the_largest_batch_under_the_target():
    kv = _exact(16)
    config = SchedulerConfig(max_num_batched_tokens=64, policy="ecoserve")
    cost = CostModel(prefill_tokens=0.01, decode_seqs=0.01, iteration=0.02)
    sched = EcoServeScheduler(config, kv, cost_model=cost, clock=MockClock(), tfs_target=0.1)
    assert sched.target_forward_size([]) == 8  # 0.02 + 0.01 * 8 = 0.1
    assert sched.target_forward_size([(5, 1), (9, 1)]) == 2 + 6  # two decodes take 0.02 of it
    assert EcoServeScheduler(config, kv, cost_model=cost, tfs_target=None).target_forward_size([]) == 64
    # By default the target is the online TPOT target.
    assert EcoServeScheduler(config, kv).tfs_target == config.online_slo.tpot


# -- same answers on a real model --------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-ecoserve")
    build_tiny_model("llama", directory)
    return directory


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)


def test_ecoserve_matches_fcfs_under_a_tight_pool_and_under_predictions(llama_dir):
    rng = random.Random(3)
    lengths = (2, 3, 2, 3, 2, 3, 5, 4)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]
    params = [_params(30)] + [_params(16)] * 7
    # The long request is predicted right and hosts the short ones (§3.4), which are predicted
    # at 2 tokens: they outgrow that into the reserved pool, then get preempted (§3.2.2).
    options = dict(predicted_len=lambda r: 30 if r.params.max_tokens == 30 else 2, padding_ratio=0.0,
                   reserved_fraction=0.2)
    common = dict(device="cpu", block_size=BLOCK, max_num_batched_tokens=32)
    ref_llm = LLM(str(llama_dir), policy="fcfs", kv_cache_tokens=1024, **common)
    reference = ref_llm.generate(prompts, params, use_tqdm=False, priority="offline")
    llm = LLM(str(llama_dir), policy="ecoserve", kv_cache_tokens=96, kv_manager_options=options, **common)
    outputs = llm.generate(prompts, params, use_tqdm=False, priority="offline")
    for ref, out, p in zip(reference, outputs, params):
        assert_close_greedy(ref, out, f"ecoserve vs fcfs: {out.request_id}", max_tokens=p.max_tokens)
    events = llm.engine.kv.events
    assert events["hosted_placements"] > 0 and events["hosted_evictions"] > 0 and events["restores"] > 0, events
    assert events["reserved_pool_draws"] > 0 and events["preemptions"] > 0, events
    assert llm.engine.stats().num_preemptions == events["preemptions"]
    assert llm.engine.kv.num_used_blocks == 0
