"""EcoServe's exact allocation (kv_manager="exact") end to end on a tiny random Llama (fp32, CPU).

Each run uses a KV pool and predictions that force one of the paper's mechanisms, then compares
every greedy output with an uninterrupted run on plenty of paged KV (vLLM's near-tie rule):

  under-prediction (§3.2.2)   every request predicted far too short: growth draws on the
                              reserved pool, and when that runs dry requests are preempted
                              without offloading and recomputed with L_new = predicted - generated
                              (fcfs over exact allocation: fcfs drops, it does not pause)
  KV pipelining (§3.4)        a long request hosts short, under-predicted ones in its unused
                              allocation; its writes reach them, so they are evicted (KV saved to
                              the host, or dropped when it is full) and restored (loaded, or
                              recomputed)

A model-free executor over real caches also runs random workloads through the real FCFS
scheduler, checking before each chunk that every earlier position of its request reads back: a
guest evicted after its chunk was planned, a save that reads a reused block, or a load into the
wrong slots fails at once. conftest turns on NANOSERVE_CHECK_INVARIANTS: the allocator's
invariants are checked after every step.
"""
from __future__ import annotations

import random

import pytest
import torch
from conftest import build_tiny_model
from kv_harness import HEAD_DIM, HEADS, LAYERS, TaggingExecutor
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory import KVBuildContext, make_kv_manager
from nanoserve.memory.host import HostKVStore
from nanoserve.request import Request
from nanoserve.sched.fcfs import FCFSScheduler

BLOCK = 4


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-exact")
    build_tiny_model("llama", directory)
    return directory


def _run(model_dir, prompts, params, **engine_kwargs):
    llm = LLM(str(model_dir), device="cpu", block_size=BLOCK, **engine_kwargs)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def _check(model_dir, prompts, params, llm, outputs, label: str) -> None:
    _, reference = _run(model_dir, prompts, params, kv_manager="paged", kv_cache_tokens=1024)
    for ref, out, p in zip(reference, outputs, params):
        assert_close_greedy(ref, out, f"{label}: {out.request_id}", max_tokens=p.max_tokens)
    assert llm.engine.kv.num_used_blocks == 0  # every block is free (or back in the reserved pool)
    assert llm.engine.kv.alloc.host_store.num_free_blocks == llm.engine.kv.alloc.host_store.num_blocks


def test_under_prediction_draws_on_the_reserved_pool_then_preempts_without_offloading(llama_dir):
    prompts, params = _prompts((5, 3, 7, 4, 6, 2), seed=0), [_params(20)] * 6
    llm, outputs = _run(llama_dir, prompts, params, kv_manager="exact", kv_cache_tokens=80,
                        kv_manager_options=dict(predicted_len=4, padding_ratio=0.0, reserved_fraction=0.2))
    events = llm.engine.kv.events
    assert events["reserved_pool_draws"] > 0 and events["preemptions"] > 0, events
    assert llm.engine.stats().num_preemptions == events["preemptions"]
    assert any(o.metrics.num_preemptions for o in outputs)
    _check(llama_dir, prompts, params, llm, outputs, "under-prediction")


@pytest.mark.parametrize("host_kv_tokens, saved", [(None, True), (0, False)], ids=["saved", "dropped"])
def test_hosted_requests_are_evicted_by_their_host_and_restored(llama_dir, host_kv_tokens, saved):
    # One long request, then short ones predicted at 2 tokens: they fit in the second half of
    # the long one's unused allocation (§3.4), outlive their prediction, and its writes reach them.
    prompts = _prompts((2, 3, 2, 3, 2, 3), seed=1)
    params = [_params(30)] + [_params(16)] * 5
    options = dict(predicted_len=lambda r: 30 if r.params.max_tokens == 30 else 2, padding_ratio=0.0,
                   reserved_fraction=0.2)
    llm, outputs = _run(llama_dir, prompts, params, kv_manager="exact", kv_cache_tokens=128,
                        host_kv_tokens=host_kv_tokens, kv_manager_options=options)
    events = llm.engine.kv.events
    assert events["hosted_placements"] > 0 and events["hosted_evictions"] > 0 and events["restores"] > 0, events
    # Saved KV is loaded back; with no host room it is dropped and the guest recomputes.
    assert (events["hosted_drops"] == 0) == saved, events
    _check(llama_dir, prompts, params, llm, outputs, "hosting")


def _manager(num_blocks: int = 16, host_blocks: int = 0, **options):
    store = HostKVStore(host_blocks, BLOCK, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    return make_kv_manager("exact", KVBuildContext(num_blocks, BLOCK, None, store, options))  # type: ignore[arg-type]


def test_predictions_come_from_options_max_tokens_or_l_new_and_fit_the_admission_pool():
    kv = _manager(padding_ratio=0.0, reserved_fraction=0.25)  # 12 admission blocks: 48 slots
    request = Request("a", [1] * 4, _params(10))
    assert kv.predicted_output_len(request) == 10  # no predictor: max_tokens
    assert _manager(predicted_len=3).predicted_output_len(request) == 3
    assert _manager(predicted_len=50).predicted_output_len(request) == 10  # never past max_tokens
    assert kv.predicted_output_len(Request("b", [1] * 40, _params(30))) == 8  # 40 + 8 fills the admission pool

    assert kv.can_reserve(request, 4) and kv.num_used_blocks == 0  # side-effect free
    assert kv.reserve(request, 4) == [] and kv.num_used_blocks == 1  # a PT: its prompt, from the pool
    assert kv.alloc.reserve_left == 3
    request.append_token(7, 0.0)
    assert kv.reserve(request, 5) == [] and kv.num_used_blocks == 4  # its GT: 4 + 10 tokens, exactly
    assert kv.alloc.reserve_left == 4  # the prompt's charge moved to A_KVC
    request.append_token(8, 0.0)
    assert kv.preempt(request) == (0, []) and kv.num_used_blocks == 0  # offload-free: recompute
    assert kv.predicted_output_len(request) == 10 - 2 and kv.events["preemptions"] == 1  # L_new
    kv.release(request)
    kv.check_invariants()

    coupled = _manager(padding_ratio=0.0, reserved_fraction=0.25, decoupled=False)
    request = Request("c", [1] * 4, _params(10))
    assert coupled.reserve(request, 4) == [] and coupled.num_used_blocks == 4  # prompt + RL at once
    coupled.release(request)


def test_a_request_that_outran_its_prediction_is_re_predicted_not_given_l_new():
    # §3.2.2's L_new = predicted - generated is <= 0 for a request that outgrew its reservation;
    # the predictor re-predicts what remains instead (the oracle: exactly the rest).
    from nanoserve.memory.predictor import OraclePredictor

    oracle = OraclePredictor({"a": 9})
    kv = _manager(padding_ratio=0.0, reserved_fraction=0.25, predicted_len=lambda r: 3)
    request = Request("a", [1] * 4, _params(20))
    kv.reserve(request, 4)
    for token in range(5):  # 5 generated against a prediction of 3
        request.append_token(token, 0.0)
    kv.preempt(request)
    assert kv.predicted_output_len(request) == 20 - 5 and kv.events["repredictions"] == 1  # plain callable: max_tokens
    kv.release(request)

    kv = _manager(padding_ratio=0.0, reserved_fraction=0.25, predicted_len=oracle)
    request = Request("a", [1] * 4, _params(20))
    kv.reserve(request, 4)
    for token in range(5):
        request.append_token(token, 0.0)
    kv.preempt(request)
    assert kv.predicted_output_len(request) == 9 - 5 and kv.events["repredictions"] == 0  # 9 - 5 > 0: the paper's L_new
    kv.reserve(request, request.num_tokens)
    for token in range(6):  # now 11 generated: past the oracle's 9 (a max_tokens-capped trace, say)
        request.append_token(token, 0.0)
    kv.preempt(request)
    assert kv.predicted_output_len(request) == 1 and kv.events["repredictions"] == 1  # the oracle knows: at least 1
    kv.release(request)
    kv.check_invariants()


def test_build_rejects_unknown_options_and_bad_predictions():
    with pytest.raises(ValueError, match="unknown"):
        _manager(padding=0.1)
    with pytest.raises(ValueError, match="predicted_len"):
        _manager(predicted_len=0)
    with pytest.raises(ValueError, match="decoupled"):
        _manager(decoupled="yes")


@pytest.mark.parametrize("seed", range(12))
def test_fcfs_over_exact_kv_keeps_every_position(seed):
    rng = random.Random(seed)
    device_blocks, host_blocks = rng.choice([16, 24, 40]), rng.choice([0, 2, 64])
    lengths = {f"r{i}": rng.randint(4, 30) for i in range(10)}
    lengths["r0"] = 40  # a long request to host the others
    predicted = {rid: max(1, length // rng.choice([1, 4, 8])) for rid, length in lengths.items()}  # often short
    predicted["r0"] = lengths["r0"]
    kv = _manager(device_blocks, host_blocks, predicted_len=lambda r: predicted[r.request_id],
                  padding_ratio=rng.choice([0.0, 0.15]), reserved_fraction=rng.choice([0.0, 0.1, 0.2]),
                  pipeline_buffer_ratio=rng.choice([0.0, 0.15]), decoupled=rng.random() < 0.5)
    executor = TaggingExecutor(kv.alloc.host_store, device_blocks, BLOCK)
    config = SchedulerConfig(max_num_batched_tokens=rng.choice([3, 6, 16]), max_num_seqs=8,
                             max_model_len=device_blocks * BLOCK)
    engine = Engine(FCFSScheduler(config, kv), executor, tokenizer=None)
    for rid, length in lengths.items():
        engine.add_request([1] * rng.randint(1, 6), SamplingParams(max_tokens=length, ignore_eos=True), rid)
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        engine.step()  # the engine checks the allocator's invariants every step
    assert not engine.has_unfinished_requests() and executor.positions_checked > 0
    assert kv.num_used_blocks == 0 and kv.alloc.host_store.num_free_blocks == host_blocks
