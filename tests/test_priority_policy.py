"""The priority policy ("vLLM++"): online requests go first and an online arrival preempts
offline work instead of waiting for it."""
from __future__ import annotations

import random

import torch
from conftest import build_tiny_model
from kv_harness import HEAD_DIM, HEADS, LAYERS, TaggingExecutor
from test_invariance import assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.config import SchedulerConfig
from nanoserve.engine import Engine
from nanoserve.memory.blocks import BlockPool
from nanoserve.memory.host import HostKVStore
from nanoserve.sched import make_scheduler


def test_online_arrival_preempts_offline_work_at_once():
    store = HostKVStore(0, 4, LAYERS, HEADS, HEAD_DIM, torch.float32, pin_memory=False)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, policy="priority")
    engine = Engine(make_scheduler(config, BlockPool(8, 4)), TaggingExecutor(store, 8, 4), tokenizer=None)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(4):
        engine.add_request([1] * 8, params, f"offline-{i}", priority="offline")
    engine.step()
    assert engine.kv.num_used_blocks == 8  # the offline prefills hold every block
    engine.add_request([2] * 8, SamplingParams(max_tokens=2, ignore_eos=True), "online", priority="online")
    engine.step()
    scheduler = engine.scheduler
    assert any(r.request_id == "online" for r in scheduler.running), "the online request had to wait"
    assert scheduler.num_preemptions >= 1 and all(r.priority == "offline" for r in scheduler.waiting)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_used_blocks == 0


def test_priority_gives_fcfs_answers_under_pressure(tmp_path):
    build_tiny_model("llama", tmp_path)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (9, 14, 5, 11, 7, 13)]
    priorities = ["offline", "online"] * 3
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    reference = LLM(str(tmp_path), device="cpu", kv_cache_tokens=1024, block_size=4)
    expected = reference.generate(prompts, params, use_tqdm=False, priority=priorities)
    llm = LLM(str(tmp_path), device="cpu", policy="priority", kv_cache_tokens=48, block_size=4)
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=priorities)
    assert llm.engine.stats().num_preemptions > 0
    for i, (ref, out) in enumerate(zip(expected, outputs)):
        assert_close_greedy(ref, out, f"prompt {i}", max_tokens=12)
