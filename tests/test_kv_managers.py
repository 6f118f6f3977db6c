"""Choosing a KV memory manager through the public API."""
from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.memory import KV_MANAGER_NAMES


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from conftest import build_tiny_model

    directory = tmp_path_factory.mktemp("llama")
    build_tiny_model("llama", directory)
    return directory


def test_unknown_manager_is_refused_with_the_choices(llama_dir):
    with pytest.raises(ValueError, match="unknown KV manager 'lru'.*arena.*paged"):
        LLM(str(llama_dir), device="cpu", kv_manager="lru", kv_cache_tokens=256)


def test_exact_caps_request_length_at_its_admission_pool(llama_dir):
    """A request longer than the blocks admission may use could never come back after an
    offload-free preemption, so the engine refuses it up front."""
    llm = LLM(str(llama_dir), device="cpu", kv_manager="exact", kv_cache_tokens=400, block_size=4,
              kv_manager_options={"reserved_fraction": 0.1})
    assert llm.engine.config.max_model_len == 360
    with pytest.raises(ValueError):
        llm.generate([[1] * 350], SamplingParams(max_tokens=20), use_tqdm=False)


@pytest.mark.parametrize("name", KV_MANAGER_NAMES)
def test_every_manager_serves_a_request_and_frees_everything(llama_dir, name):
    llm = LLM(str(llama_dir), device="cpu", kv_manager=name, kv_cache_tokens=256, block_size=4)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4
    assert llm.engine.kv.num_used_blocks == 0 and llm.engine.stats().kv_blocks_used == 0


def _running(request_id: str, tokens: int, priority: str = "online"):
    from nanoserve.request import Request, RequestStatus
    request = Request(request_id, [1] * tokens, SamplingParams(max_tokens=4), priority=priority)
    request.status = RequestStatus.RUNNING
    return request


def test_fits_after_preempting_counts_free_blocks_and_the_victims_blocks():
    # BROS passes over an RT request that could not get KV even after its evictions (Alg. 1:
    # memory before risk); the manager answers without changing anything.
    from nanoserve.memory.blocks import BlockPool
    from nanoserve.memory.manager import PagedKV
    from nanoserve.request import Request
    kv = PagedKV(BlockPool(8, 4))
    a, b = _running("a", 12, "offline"), _running("b", 16, "offline")
    kv.reserve(a, 12)
    kv.reserve(b, 16)  # 3 + 4 blocks used, 1 free
    newcomer = Request("new", [1] * 20, SamplingParams(max_tokens=4))  # waiting: 5 blocks, none held
    assert not kv.fits_after_preempting(newcomer, 20, [])
    assert not kv.fits_after_preempting(newcomer, 20, [a])  # 1 + 3
    assert kv.fits_after_preempting(newcomer, 20, [a, b])
    assert kv.fits_after_preempting(a, 16, [])  # a grows by the one free block
    assert kv.num_used_blocks == 7


def test_bidirectional_rt_fits_where_free_or_be_only_blocks_can_take_its_pages():
    import torch

    from nanoserve.memory.bidirectional import BidirectionalBlockManager
    from nanoserve.memory.bidirectional_kv import BidirectionalKV
    from nanoserve.memory.host import HostKVStore
    from nanoserve.request import Request
    store = HostKVStore(0, 4, 2, 1, 2, torch.float32, pin_memory=False)  # no host: no checkpoint room
    kv = BidirectionalKV(BidirectionalBlockManager(4, 4, store))
    rt, be = _running("rt", 8), _running("be", 8, "offline")
    kv.reserve(rt, 8)  # blocks 0-1, RT side
    kv.reserve(be, 8)  # two blocks: BE pages on free blocks (FindBlock: most empty slots)
    newcomer = Request("new", [1] * 8, SamplingParams(max_tokens=4))
    assert kv.blocks.rt_page_room() == 2 and kv.blocks.rt_pages_lacking("new", 8) == 2
    # Overwriting BE slots needs host room to checkpoint them, so it cannot reserve now; with
    # the BE request evicted (dropped: recompute) its two blocks take the RT pages.
    assert not kv.can_reserve(newcomer, 8)
    assert kv.fits_after_preempting(newcomer, 8, [be])
    assert not kv.fits_after_preempting(newcomer, 12, [be])  # 3 pages, 2 blocks without an RT page


def test_policy_options_reach_the_policy_and_unknown_ones_are_refused(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", policy="bros", kv_cache_tokens=256, block_size=4,
              policy_options={"initial_batch_size": 4, "batch_growth": "+2", "prefill": "whole"})
    scheduler = llm.engine.scheduler
    assert (scheduler.batch_size, scheduler.batch_size_step, scheduler.whole_prompts) == (4, 2, True)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 3
    with pytest.raises(ValueError, match="policy 'fcfs' takes no option batch_growth"):
        LLM(str(llama_dir), device="cpu", policy="fcfs", kv_cache_tokens=256, policy_options={"batch_growth": "x2"})
