"""CheckpointKV (ConServe §4.4 behind the KVManager interface) driven by the real FCFS scheduler.

Three levels: the adapter alone (ranking, exact can_reserve, prefetch on reserve); the real
Engine with a model-free executor that writes a unique value for every (request, position) into
real caches, runs the step's copies, and checks before each chunk that every earlier position
reads back (so a restore that loads the wrong block, or a save that reads a block after it was
reused, fails at once); and a tiny random Llama whose greedy outputs under checkpoint-and-resume
must match an uninterrupted run.
"""
from __future__ import annotations

import random

import pytest
import torch
from kv_harness import HEAD_DIM, HEADS, LAYERS, TaggingExecutor, serve_random_requests
from mixed_greedy import MAX_TOKENS, PARAMS, PRIORITIES, PROMPTS, llama_dir, reference  # noqa: F401 (fixtures)
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory import KVBuildContext, make_kv_manager
from nanoserve.memory.blocks import BlockPool, NoFreeBlocksError
from nanoserve.memory.checkpoint import CheckpointConfig
from nanoserve.memory.checkpoint_kv import CheckpointKV
from nanoserve.memory.copies import LANDED_NOW
from nanoserve.memory.host import HostKVStore
from nanoserve.request import Request
from nanoserve.sched.fcfs import FCFSScheduler

B = 4


def make_kv(device_blocks: int, host_blocks: int, **config) -> CheckpointKV:
    store = HostKVStore(host_blocks, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    return CheckpointKV(BlockPool(device_blocks, B), store, CheckpointConfig(**config))


def make_request(rid: str, num_tokens: int, priority: str = "online") -> Request:
    return Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=8), priority=priority)


def land(kv: CheckpointKV, copies) -> None:
    """Issue `copies` as an executor would, let them land, and poll as the next step's start does."""
    for copy in copies:
        kv.host_store.inflight.issue(copy, LANDED_NOW)
    kv.poll_copies()


def run_step(kv: CheckpointKV, requests: list[Request], extra: int = 0) -> None:
    """Stand-in for a step: report computed tokens, then grow each request by `extra`."""
    land(kv, kv.step_copies(requests))
    for r in requests:
        kv.reserve(r, r.num_computed_tokens + extra)
        r.num_computed_tokens += extra


# -- the adapter alone ----------------------------------------------------------------------
def test_offline_requests_are_checkpointed_first():
    kv = make_kv(10, 10, threshold=0.5, max_blocks_per_step=100)
    online, offline = make_request("on", 12), make_request("off", 8, "offline")
    for r in (online, offline):  # 5 of 10 blocks: exactly one request is chosen
        kv.reserve(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
    copies = kv.step_copies([online, offline])
    assert len(copies) == 1 and kv.checkpointer.saved_blocks("off") == 2 and kv.checkpointer.saved_blocks("on") == 0
    assert kv.events["blocks_checkpointed"] == 2


def test_preempt_keeps_checkpoint_and_reserve_prefetches_exactly():
    kv = make_kv(6, 8, threshold=0.0)
    r = make_request("r", 10)
    kv.reserve(r, 10)
    r.num_computed_tokens = 10
    saves = kv.step_copies([r])  # saves the 2 full blocks, not the partial third
    kept, copies = kv.preempt(r)
    # The saves have not landed yet: their 2 blocks are held, and r cannot resume.
    assert (kept, copies) == (8, []) and kv.num_used_blocks == 2 and not kv.can_reserve(r, 10)
    land(kv, saves)
    assert kv.num_used_blocks == 0
    assert kv.events["preemptions_with_checkpoint"] == 1
    r.num_computed_tokens = kept
    other = make_request("other", 12)
    kv.reserve(other, 12)  # 3 of 6 blocks left: r needs 3 for 10 tokens, not 4 for 13
    assert kv.can_reserve(r, 10) and not kv.can_reserve(r, 13)
    with pytest.raises(NoFreeBlocksError):
        kv.reserve(r, 13)
    assert kv.checkpointer.is_preempted("r") and kv.num_used_blocks == 3  # nothing changed
    loads = kv.reserve(r, 10)
    assert [c.kind for c in loads] == ["load"] and len(loads[0].dst) == 8
    assert kv.block_table(r)[:2] == [loads[0].dst[0] // B, loads[0].dst[B] // B]
    assert kv.events["prefetches"] == 1 and kv.events["tokens_saved_from_recompute"] == 8
    kv.check_invariants()
    kv.release(r), kv.release(other)
    assert kv.num_used_blocks == 2  # the load is still in flight: its blocks are held
    land(kv, loads)
    assert kv.num_used_blocks == 0 and kv.checkpointer.store.num_free_blocks == 8
    kv.check_invariants()


def test_preempt_without_checkpoint_recomputes_everything():
    kv = make_kv(8, 8, threshold=1.0)
    r = make_request("r", 10)
    run_step(kv, [r], 10)
    assert kv.preempt(r) == (0, []) and kv.num_used_blocks == 0
    assert kv.reserve(r, 4) == []  # a fresh start: no loads


def test_build_validates_options():
    store = HostKVStore(4, B, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    kv = make_kv_manager("checkpoint", KVBuildContext(8, B, None, store, {"threshold": 0.2}))  # type: ignore[arg-type]
    assert isinstance(kv, CheckpointKV) and kv.checkpointer.config.threshold == 0.2
    with pytest.raises(ValueError, match="unknown checkpoint option"):
        make_kv_manager("checkpoint", KVBuildContext(8, B, None, store, {"treshold": 0.2}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host KV store"):
        make_kv_manager("checkpoint", KVBuildContext(8, B, None, None))  # type: ignore[arg-type]


# -- the real scheduler, a model-free executor over real caches ------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_fcfs_over_checkpoint_kv_restores_every_position(seed):
    rng = random.Random(seed)
    device_blocks = 12
    kv = make_kv(device_blocks, 64, threshold=rng.choice([0.0, 0.3, 0.6]), max_blocks_per_step=rng.choice([1, 3, 8]))
    executor = TaggingExecutor(kv.checkpointer.store, device_blocks, B)
    config = SchedulerConfig(max_num_batched_tokens=rng.choice([6, 16]), max_num_seqs=6,
                             max_model_len=device_blocks * B)
    engine = Engine(FCFSScheduler(config, kv), executor, tokenizer=None)
    assert serve_random_requests(engine, rng, max_tokens=(4, 20), max_steps=2000) == 8
    assert executor.positions_checked > 0
    assert kv.num_used_blocks == 0 and kv.checkpointer.store.num_free_blocks == 64
    # Every seed's workload overflows the pool, and the checkpoints make preemption cheap.
    assert engine.scheduler.num_preemptions > 0
    assert kv.events["preemptions_with_checkpoint"] > 0 and kv.events["prefetches"] > 0


def test_fcfs_resumes_from_checkpoints_under_pressure():
    """A fixed workload, half online, half offline, whose preemptions resume from host copies."""
    kv = make_kv(10, 64, threshold=0.0, max_blocks_per_step=8)
    executor = TaggingExecutor(kv.checkpointer.store, 10, B)
    engine = Engine(FCFSScheduler(SchedulerConfig(max_num_batched_tokens=16, max_model_len=40), kv), executor, None)
    for i in range(4):
        engine.add_request([1 + i] * 9, SamplingParams(max_tokens=16, ignore_eos=True), f"r{i}",
                           priority="offline" if i % 2 else "online")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    events = kv.events
    assert events["preemptions_with_checkpoint"] > 0 and events["prefetches"] > 0
    assert events["tokens_saved_from_recompute"] > 0
    assert kv.num_used_blocks == 0 and kv.checkpointer.store.num_free_blocks == 64


# -- a tiny random Llama: greedy output survives checkpoint, preempt and resume ------------------------------
def test_greedy_output_survives_checkpointed_preemption(llama_dir, reference):
    # 16 blocks for 8 requests of up to 43 tokens: preemption is certain; threshold 0.25
    # starts checkpointing early so preempted requests resume from their host copies.
    llm = LLM(llama_dir, device="cpu", dtype="float32", kv_cache_tokens=64, block_size=B,
              kv_manager="checkpoint", kv_manager_options={"threshold": 0.25, "max_blocks_per_step": 8},
              host_kv_tokens=2048)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=PRIORITIES)
    for ref, out in zip(reference, outputs):
        assert_close_greedy(ref, out, f"checkpoint: {out.prompt_token_ids[:4]}", max_tokens=MAX_TOKENS)
    kv = llm.engine.kv
    assert isinstance(kv, CheckpointKV)
    events = kv.events
    assert llm.engine.stats().num_preemptions > 0, "the KV pool was meant to force preemptions"
    assert events["blocks_checkpointed"] > 0
    assert events["preemptions_with_checkpoint"] > 0 and events["tokens_saved_from_recompute"] > 0
    assert events["prefetches"] > 0
    assert llm.engine.stats().kv_blocks_used == 0
    assert kv.checkpointer.store.num_free_blocks == kv.checkpointer.store.num_blocks


def test_threshold_holds_with_a_big_pool(llama_dir, reference):
    llm = LLM(llama_dir, device="cpu", dtype="float32", kv_cache_tokens=4096, block_size=B,
              kv_manager="checkpoint", kv_manager_options={"threshold": 0.5})
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=PRIORITIES)
    for ref, out in zip(reference, outputs):
        assert_close_greedy(ref, out, f"big pool: {out.prompt_token_ids[:4]}", max_tokens=MAX_TOKENS)
    events = llm.engine.kv.events
    assert events.keys() >= {"blocks_checkpointed", "preemptions_with_checkpoint", "prefetches", "pauses"}
    # No checkpoint mechanism fired (the prefix cache's lookups, which every admission makes, aside).
    assert {n for key, n in events.items() if not key.startswith("prefix_cache_")} == {0}, events
    assert llm.engine.stats().num_preemptions == 0 and llm.engine.stats().kv_blocks_used == 0
