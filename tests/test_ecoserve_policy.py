"""EcoServe's scheduling policy (policy="ecoserve", ecoserve.txt §3) over exact allocation.

- Behaviour, through the real Engine with a model-free executor (kv_harness.TaggingExecutor) and a
  mock clock: with correct response-length predictions (an OraclePredictor) a workload that fills
  the KV pool never has a request outgrow its allocation, so nothing is ever preempted or paused,
  no allocation fails and no guest is evicted (§3.2: exact allocation avoids KV allocation
  failures); the same workload under-predicted draws on the reserved pool and pauses GTs that
  keep their KV (§3.2.2), and still produces every token.
- Decoupling (§3.2.1): a PT holds only its prompt's KV, charged to the reserved pool, and waits in
  Q_G after its prompt until A_KVC holds its RL; while GTs fill the KV, PTs still get the pool.
- Selection: equal-RL groups from Q_G fill A_KVC with a bisect past a head that does not fit
  (§3.2.1, §3.3); deadline buckets come first, then occupied KV; the TFS comes from the cost model.
- Same answers: a tiny random Llama (fp32, CPU) with a tight pool and under-predicted lengths
  gives the same greedy outputs under ecoserve as under fcfs, with hosting (§3.4), the reserved
  pool and offload-free preemption (§3.2.2) all exercised.
"""
from __future__ import annotations

import random

import pytest
import torch
from conftest import build_tiny_model
from kv_harness import HEAD_DIM, HEADS, LAYERS, MockClock, TaggingExecutor
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory import KVBuildContext, make_kv_manager
from nanoserve.memory.host import HostKVStore
from nanoserve.memory.predictor import OraclePredictor
from nanoserve.request import Request
from nanoserve.sched.cost_model import CostModel
from nanoserve.sched.ecoserve import EcoServeScheduler
from nanoserve.slo import SLO

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
    assert events["preemptions"] == events["pauses"] == engine.scheduler.num_preemptions == 0, events
    assert events["reserved_pool_draws"] == 0 and events["hosted_evictions"] == 0, events
    assert events["batches"] > 0 and engine.scheduler.queued_drops == 0, events
    # Reserving max_tokens (no predictor) is just as safe, but runs fewer requests at once.
    _, _, without = _run(_exact(24, padding_ratio=0.0, reserved_fraction=0.1), 24, workload, seed)
    assert concurrency > without


@pytest.mark.parametrize("seed", range(4))
def test_under_predictions_draw_on_the_reserved_pool_then_pause_and_still_finish(seed):
    workload = _workload(seed)
    kv = _exact(24, predicted_len=2, padding_ratio=0.0, reserved_fraction=0.1)
    engine, _, _ = _run(kv, 24, workload, seed)
    events = kv.events
    assert events["reserved_pool_draws"] > 0 and events["pauses"] > 0, events
    # Every preemption kept the KV (a pause) or dropped it; the queue's liveness drops are the rest.
    assert engine.scheduler.num_preemptions + engine.scheduler.queued_drops == events["pauses"] + events["preemptions"]


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
                pipeline_buffer_ratio=rng.choice([0.0, 0.15]), decoupled=rng.random() < 0.8)
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


def _step(sched, now: float = 100.0) -> list[str]:
    """One scheduled step, executed: chunks that reach their request's end sample token 7."""
    out = sched.schedule()
    sched.update_after_step(out)
    for chunk in out.chunks:
        if chunk.samples:
            chunk.request.append_token(7, now)
    return [c.request.request_id for c in out.chunks]


def test_a_pt_holds_its_prompt_from_the_reserved_pool_and_its_gt_waits_for_its_rl():
    # 20 blocks of 4, 4 of them the reserved pool; o's GT fills A_KVC (16 blocks).
    kv = _exact(20, predicted_len=lambda r: 62 if r.request_id == "o" else 10, padding_ratio=0.0,
                reserved_fraction=0.2, pipeline_buffer_ratio=100.0)  # no hosting
    sched = _scheduler(kv)
    sched.add_request(_request("o", max_tokens=62))
    assert _step(sched) == ["o"] and kv.num_used_blocks == 1 and kv.alloc.reserve_left == 3  # a PT: its prompt
    assert _step(sched) == ["o"] and kv.num_used_blocks == 16 and kv.alloc.reserve_left == 4  # its GT: 2 + 62
    for rid in "ab":
        sched.add_request(_request(rid, prompt_len=6))
    # A_KVC is full, yet both prompts run: each holds 2 blocks of the reserved pool (§3.2.1).
    assert _step(sched) == ["o", "a", "b"] and kv.alloc.reserve_left == 0
    assert kv.alloc.num_admission_blocks == 0
    # Their prompts are done: they wait in Q_G with their prompt KV, and o decodes alone.
    assert _step(sched) == ["o"] and [r.request_id for r in sched.waiting] == ["a", "b"]
    assert kv.alloc.num_queued == 2 and len(sched._generations) == 2
    # New prompts wait too: the pool is spent on queued GTs' prompts, and nothing else is free.
    sched.add_request(_request("c"))
    assert _step(sched) == ["o"]
    kv.check_invariants()


def test_equal_rl_groups_fill_a_kvc_past_a_head_that_does_not_fit():
    rl = {"o": 22, "a": 44, "b": 14, "c": 14, "d": 6}
    # A huge pipeline buffer keeps §3.4 hosting out of this test: only A_KVC counts.
    kv = _exact(20, predicted_len=lambda r: rl[r.request_id], padding_ratio=0.0, reserved_fraction=0.2,
                pipeline_buffer_ratio=100.0)
    sched = _scheduler(kv)
    sched.add_request(_request("o"))
    _step(sched)
    _step(sched)  # o's GT: 2 + 22 tokens, 6 of the 16 A_KVC blocks
    for rid in "abcd":
        sched.add_request(_request(rid))
    assert _step(sched) == ["o", "a", "b", "c", "d"]  # four PTs: one pool block each
    # o decodes; FCFS would stop at a (2 + 44 tokens: 11 blocks, 10 free); the RL=14 group (4
    # blocks each) is the longest that fits, and d (2 blocks) takes the rest (§3.2.1, §3.3).
    assert _step(sched) == ["o", "b", "c", "d"]
    assert kv.alloc.num_admission_blocks == 0 and [r.request_id for r in sched.waiting] == ["a"]


def test_deadline_buckets_come_before_occupied_kv_and_length():
    kv = _exact(16, padding_ratio=0.0, reserved_fraction=0.0)  # predictions: max_tokens
    sched = _scheduler(kv, max_seqs=1)
    sched.add_request(_request("batch", max_tokens=40, priority="offline", slo=SLO()))  # no deadline
    sched.add_request(_request("chat", max_tokens=10, slo=SLO(ttft=0.3, tpot=0.05)))  # due in 0.3 s
    assert [c.request.request_id for c in sched.schedule().chunks] == ["chat"]

    # Same deadline bucket: a paused GT (it holds KV for 200 generated tokens) goes before a new
    # GT with a longer RL (§3.2.2: "it occupies a certain KVC and will be given a higher priority").
    sched = _scheduler(_exact(16, padding_ratio=0.0, reserved_fraction=0.0))
    new, paused = _request("new", max_tokens=400), _request("old", max_tokens=300)
    paused.token_ids += [5] * 200
    for request in (new, paused):
        request.slo = SLO()
        request.num_computed_tokens = request.num_tokens - 1  # both hold all but their last token
        sched.add_request(request)
    sched._queue_arrivals(100.0)
    groups = sched._generations.groups()
    assert [sched._generations.members(g) for g in groups] == [[paused], [new]]


@pytest.mark.parametrize("long_prompts", ["decoupled", "coupled"])
def test_a_prompt_longer_than_the_pool_is_admitted_decoupled_from_a_kvc(long_prompts):
    # §3.2.1: "The KVC size allocated to a PT equals its prompt length"; PTs fill "the available
    # KVC space". The pool is 2 blocks (8 tokens); the prompt is 20 tokens, its RL 30.
    kv = _exact(20, predicted_len=30, padding_ratio=0.0, reserved_fraction=0.1, long_prompts=long_prompts)
    sched = _scheduler(kv)
    sched.add_request(_request("long", prompt_len=20, max_tokens=30))
    assert _step(sched) == ["long"]
    if long_prompts == "decoupled":  # its prompt only, from A_KVC: 5 blocks
        assert kv.num_used_blocks == 5 and kv.events["prompt_admissions_available"] == 1 and kv.events["spills"] == 0
    else:  # the earlier reading: prompt + RL at once (50 tokens: 13 blocks)
        assert kv.num_used_blocks == 13 and kv.events["spills"] == 1
    assert _step(sched) == ["long"] and kv.num_used_blocks == 13  # its GT holds its RL either way
    kv.check_invariants()


def test_the_jct_deadline_ranks_a_paused_gt_ahead_of_later_arrivals():
    # §3.3 orders by "JCT SLO" first; §4: deadline = arrival + SLO-scale x (t_p + t_g x RL). A GT
    # that paused (it arrived at 90, 200 tokens generated, L_new 100) is due at 90 + 1 + 0.01 x 300
    # = 94 < now; a fresh GT that arrived at 100 with RL 400 at 105: the paused one goes first,
    # even though its per-token pace (first token at 90.5, TPOT 1 s) would put it last.
    slo = SLO(ttft=1.0, tpot=1.0, jct_fixed=1.0, jct_per_token=0.01)
    kv = _exact(200, padding_ratio=0.0, reserved_fraction=0.0)  # predictions: max_tokens left
    sched = _scheduler(kv)
    paused, fresh = _request("paused", max_tokens=300, slo=slo), _request("fresh", max_tokens=400, slo=slo)
    paused.arrival_time, paused.first_token_time = 90.0, 90.5
    paused.token_ids += [5] * 200
    for request in (fresh, paused):
        request.num_computed_tokens = request.num_tokens - 1
        sched.add_request(request)
    assert sched.deadline(paused) == pytest.approx(94.0) and sched.deadline(fresh) == pytest.approx(105.0)
    assert sched.next_token_deadline(paused) > sched.next_token_deadline(fresh)  # the old key's order
    sched._queue_arrivals(100.0)
    assert [m for g in sched._generations.groups() for m in sched._generations.members(g)] == [paused, fresh]


def _queued_gts(sched, rls: dict[str, int]):
    for i, rid in enumerate(rls):
        request = _request(rid, max_tokens=rls[rid])
        request.arrival_time = 100.0 + i
        request.num_computed_tokens = request.num_tokens - 1  # a GT: its prompt is done
        sched.add_request(request)


@pytest.mark.parametrize("synced", [False, True])
def test_without_ordering_gts_go_in_arrival_order_and_synced_takes_a_group_whole(synced):
    # Fig. 11's EcoServe-D and -SD: FCFS queues; -SD batches a GT with the queued GTs of its RL.
    rls = {"a": 8, "b": 30, "c": 8, "d": 4}
    kv = _exact(40, predicted_len=lambda r: rls[r.request_id], padding_ratio=0.0, reserved_fraction=0.0,
                pipelining=False)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, max_model_len=kv.max_request_tokens,
                             policy="ecoserve", policy_options={"ordering": False, "synced": synced})
    sched = EcoServeScheduler(config, kv, clock=MockClock(), tfs_target=None)
    _queued_gts(sched, rls)
    # Two sequences at most: D takes a then b (arrival order), SD takes a with c (its group).
    assert [c.request.request_id for c in sched.schedule().chunks] == (["a", "c"] if synced else ["a", "b"])
    assert sched.counters()["group_batches"] == int(synced)


def test_pipelining_off_hosts_no_gt():
    # §3.4 off (Fig. 11's EcoServe-SDO): a GT that would fit in the host's unused region takes A_KVC.
    for pipelining, hosted in ((True, 1), (False, 0)):
        rls = {"h": 40, "g": 10}
        kv = _exact(40, predicted_len=lambda r: rls[r.request_id], padding_ratio=0.0, reserved_fraction=0.25,
                    pipeline_buffer_ratio=0.15, pipelining=pipelining)
        sched = _scheduler(kv)
        sched.add_request(_request("h", prompt_len=4, max_tokens=40))
        _step(sched)
        _step(sched)  # h's GT: 44 tokens
        sched.add_request(_request("g", prompt_len=3, max_tokens=10))
        _step(sched)
        _step(sched)  # g's GT: hosted in h's region, or not
        assert kv.events["hosted_placements"] == hosted
        kv.check_invariants()


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
    # at 2 tokens: they outgrow that into the reserved pool, then pause (§3.2.2).
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
    assert events["reserved_pool_draws"] > 0 and events["pauses"] > 0, events
    assert llm.engine.stats().num_preemptions == events["pauses"] + events["preemptions"]
    assert llm.engine.kv.num_used_blocks == 0
