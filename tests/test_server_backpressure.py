"""Back-pressure, deadlines and what the server reports: `--max-queued` turns online requests
away with 429 and Retry-After (offline ones are only queued), a draining server answers 503, a
request past its deadline is cut off with 408, and /metrics and the request log say what happened.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re

import httpx
import pytest
from openai import OpenAI, RateLimitError
from server_fixtures import LiveServer, leaks, live_server

MAX_QUEUED = 2


@pytest.fixture(scope="module")
def live():
    # One sequence at a time, so that concurrent requests really queue.
    with live_server({"max_queued": MAX_QUEUED}, max_num_seqs=1) as server:
        yield server
        server.wait_idle()
        assert not leaks(server), leaks(server)


async def burst(live: LiveServer, count: int, priority: str, max_tokens: int = 24) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=live.url, timeout=300) as http:
        return await asyncio.gather(*(http.post("/v1/completions", json={
            "prompt": f"Count to {i}:", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "priority": priority}) for i in range(count)))


def test_online_burst_past_max_queued_gets_429_with_retry_after(live: LiveServer):
    replies = asyncio.run(burst(live, 10, "online"))
    refused = [r for r in replies if r.status_code == 429]
    served = [r for r in replies if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == len(replies)
    assert len(served) >= MAX_QUEUED  # those admitted before the queue filled
    for reply in refused:
        error = reply.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "rate_limit_exceeded"
        assert str(MAX_QUEUED) in error["message"]
        assert int(reply.headers["Retry-After"]) >= 1
    for reply in served:
        assert reply.json()["usage"]["completion_tokens"] == 24


def test_offline_burst_is_queued_never_refused(live: LiveServer):
    replies = asyncio.run(burst(live, 10, "offline", max_tokens=8))
    assert [r.status_code for r in replies] == [200] * 10
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in replies)


def test_official_client_sees_a_rate_limit_error(live: LiveServer):
    async def flood() -> list:
        from openai import AsyncOpenAI
        client = AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0)
        return await asyncio.gather(*(client.completions.create(model=live.model, prompt="Hi", max_tokens=16)
                                      for _ in range(8)), return_exceptions=True)

    outcomes = asyncio.run(flood())
    assert any(isinstance(o, RateLimitError) for o in outcomes)
    assert all(isinstance(o, RateLimitError) or o.choices[0].text is not None for o in outcomes)


def test_draining_server_answers_503(live: LiveServer):
    admission = live.app.state.server.admission
    admission.draining = True
    try:
        reply = httpx.post(live.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 503 and int(reply.headers["Retry-After"]) >= 1
        assert reply.json()["error"]["type"] == "service_unavailable_error"
        assert httpx.get(live.url + "/health", timeout=60).status_code == 503
    finally:
        admission.draining = False
    assert httpx.get(live.url + "/health", timeout=60).status_code == 200


def test_request_past_its_timeout_gets_408_and_is_aborted(live: LiveServer):
    reply = httpx.post(live.url + "/v1/completions", json={
        "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True, "timeout": 0.3}, timeout=120)
    assert reply.status_code == 408, reply.text
    error = reply.json()["error"]
    assert error["type"] == "timeout_error" and error["code"] == "request_timeout"
    live.wait_idle()  # the aborted request gave its KV back


def test_streaming_request_past_its_timeout_ends_with_an_error_event(live: LiveServer):
    with httpx.stream("POST", live.url + "/v1/completions", json={
            "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True, "timeout": 2.0,
            "stream": True}, timeout=120) as reply:
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line]
    assert reply.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert len(events) > 2  # some tokens came before the cut
    live.wait_idle()


def test_server_wide_request_timeout():
    # Timeouts of seconds, not tenths: on a loaded 2-core CI machine a 2-token reply can take
    # 0.3 s, while 1,500 tokens always take far longer than 3 s.
    with live_server({"request_timeout": 3.0}) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        reply = client.completions.create(model=server.model, prompt="Hi", max_tokens=2)  # well within it
        assert reply.usage.completion_tokens == 2
        long = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1500,
                                                                "ignore_eos": True}, timeout=120)
        assert long.status_code == 408
        # A body's timeout may only shorten the server's, never lengthen it.
        longer = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1500,
                                                                  "ignore_eos": True, "timeout": 600}, timeout=120)
        assert longer.status_code == 408
        server.wait_idle()
        assert not leaks(server)


def test_metrics_per_class_step_time_and_refusals(live: LiveServer):
    asyncio.run(burst(live, 2, "offline", max_tokens=4))
    asyncio.run(burst(live, 1, "online", max_tokens=4))
    text = httpx.get(live.url + "/metrics", timeout=60).text

    def value(pattern: str) -> float:
        match = re.search(r"^" + pattern + r" (\S+)$", text, re.M)
        assert match, f"no sample matching {pattern}"
        return float(match.group(1))

    for klass in ("online", "offline"):
        assert value(rf'nanoserve_time_to_first_token_seconds_count\{{[^}}]*priority="{klass}"[^}}]*\}}') >= 1
        assert value(rf'nanoserve_e2e_request_latency_seconds_count\{{[^}}]*priority="{klass}"[^}}]*\}}') >= 1
        assert value(rf'nanoserve_requests_queued\{{[^}}]*priority="{klass}"[^}}]*\}}') == 0
    assert value(r"nanoserve_scheduler_step_seconds_count\{[^}]*\}") > 0
    assert value(r"nanoserve_requests_rejected_total\{[^}]*\}") >= 1  # the 429s above
    assert value(r'nanoserve_request_errors_total\{[^}]*type="rate_limit_exceeded"[^}]*\}') >= 1
    assert "nanoserve_kv_events_total" in text


def test_one_json_log_line_per_request(live: LiveServer, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="nanoserve.requests"):
        reply = httpx.post(live.url + "/v1/completions", json={
            "prompt": "Hello", "max_tokens": 3, "n": 2, "temperature": 0, "priority": "offline"}, timeout=120)
        assert reply.status_code == 200
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "nanoserve.requests"]
    mine = [line for line in lines if line["id"].startswith(reply.json()["id"])]
    assert len(mine) == 2  # one per choice: each is its own engine request
    for line in mine:
        assert line["event"] == "request" and line["class"] == "offline" and line["output_tokens"] == 3
        assert line["finish_reason"] == "length" and line["prompt_tokens"] > 0
        assert line["ttft_s"] > 0 and line["e2e_s"] >= line["ttft_s"]
