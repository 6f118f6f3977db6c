"""Request classes: every request is "online" or "offline", set per prompt through the API."""
from __future__ import annotations

import json
import pickle

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.request import Request
from nanoserve.sim.workloads import TraceRequest
from nanoserve.slo import DEFAULT_SLOS, PRIORITIES, RequestClass


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


def test_a_request_class_is_a_member_coerced_from_its_string():
    params = SamplingParams(max_tokens=2)
    assert Request("a", [1, 2], params, priority="offline").priority is RequestClass.OFFLINE
    assert Request("b", [1, 2], params).priority is RequestClass.ONLINE
    assert TraceRequest(0.0, 5, 5, "offline").priority is RequestClass.OFFLINE
    assert PRIORITIES == (RequestClass.ONLINE, RequestClass.OFFLINE)
    with pytest.raises(ValueError, match=r"^priority must be one of online, offline, got 'batch'$"):
        Request("c", [1, 2], params, priority="batch")
    with pytest.raises(ValueError, match=r"^priority must be one of online, offline, got 'Online'$"):
        RequestClass("Online")


def test_a_request_class_reads_as_its_string():
    assert RequestClass.ONLINE == "online" and RequestClass.OFFLINE != "online"
    assert f"{RequestClass.OFFLINE}" == "offline" and str(RequestClass.ONLINE) == "online"
    assert DEFAULT_SLOS["online"] is DEFAULT_SLOS[RequestClass.ONLINE]  # string lookups still work
    assert pickle.loads(pickle.dumps(RequestClass.OFFLINE)) is RequestClass.OFFLINE  # across processes
    assert json.dumps({RequestClass.ONLINE: RequestClass.OFFLINE}) == '{"online": "offline"}'


def test_engine_stats_are_keyed_by_members_and_dump_as_strings(llm):
    per_class = llm.engine.stats().per_class
    assert [type(k) for k in per_class] == [RequestClass, RequestClass]
    assert list(json.loads(json.dumps(per_class))) == ["online", "offline"]
    assert per_class["offline"] is per_class[RequestClass.OFFLINE]
