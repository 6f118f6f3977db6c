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
