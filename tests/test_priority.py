"""Request classes: every request is "online" or "offline", set per prompt through the API."""
from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from conftest import build_tiny_model

    directory = tmp_path_factory.mktemp("llama")
    build_tiny_model("llama", directory)
    return LLM(str(directory), device="cpu", kv_cache_tokens=512, block_size=4)


def test_priority_per_prompt_reaches_the_requests(llm):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    seen = []
    add = llm.engine.add_request

    def spy(*args, **kwargs):
        request = add(*args, **kwargs)
        seen.append(request.priority)
        return request

    llm.engine.add_request = spy
    try:
        outputs = llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False, priority=["offline", "online"])
        llm.generate([[6, 7]], params, use_tqdm=False, priority="offline")
    finally:
        del llm.engine.add_request
    assert seen == ["offline", "online", "offline"]
    assert all(len(o.token_ids) == 3 for o in outputs)


@pytest.mark.parametrize("priority", ["urgent", ["online"]])
def test_bad_priorities_are_refused_before_any_work(llm, priority):
    with pytest.raises(ValueError, match="priorit"):
        llm.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=2), use_tqdm=False, priority=priority)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_used_blocks == 0


def test_engine_refuses_an_unknown_class(llm):
    with pytest.raises(ValueError, match="priority must be one of online, offline"):
        llm.engine.add_request([1, 2], SamplingParams(max_tokens=2), priority="batch")
    assert not llm.engine.has_unfinished_requests()
