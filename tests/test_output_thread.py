"""Outputs made off the engine's thread (output_processor.py, async_engine.py's output thread,
the server's default) and on it (`--no-output-thread`): the caller sees the same outputs, token
for token; a stop string found late ends the output where it formed and the engine drops what it
computed past it; failures on either thread reach the streams and the server keeps serving,
with no KV leaked. The other server tests run with the default."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import OpenAI
from server_fixtures import LiveServer, leaks, live_server

from nanoserve import LLM, SamplingParams
from nanoserve.async_engine import AsyncEngine, EngineError

PROMPT = "Count: one, two, three,"


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), device="cpu", kv_cache_tokens=4096, max_model_len=512)


@pytest.fixture(scope="module", params=[True, False], ids=["output-thread", "engine-thread"])
def threaded(request) -> LiveServer:
    with live_server(output_thread=request.param) as live:
        assert live.engine.makes_outputs_on_own_thread == request.param
        yield live
        assert live.wait_idle()["nanoserve_kv_blocks_used"] == 0, "KV blocks leaked"
        assert live.engine.is_running, f"the engine thread died: {live.engine.last_error}"


def test_a_stop_string_found_steps_late_ends_the_output_where_it_formed(llm):
    """The output processor runs three steps behind the engine: the stop string it finds ends
    the output at the token that completed it, as on the engine's own thread, and the engine
    drops the tokens it computed past it and frees their KV."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(PROMPT, greedy, use_tqdm=False)[0]
    stop = full.text[5:8]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    inline = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert inline.finish_reason == "stop" and inline.stop_reason == stop

    engine = llm.engine
    request = engine.add_request(PROMPT, params)
    late, made = [], []
    while engine.has_unfinished_requests():
        late.append(engine.step_core())
        if len(late) > 3:  # the output thread is three steps behind
            outputs, stops = engine.output_processor().process(late.pop(0))
            made += outputs
            for found in stops:
                assert request.num_output_tokens > found.num_output_tokens  # tokens past it were computed
                engine.stop_request(found)
    for core in late:  # core outputs of a request that ended: dropped
        assert engine.output_processor().process(core) == ([], [])
    final = made[-1]
    assert final.finished and [o.finished for o in made].count(True) == 1
    assert (final.text, final.token_ids, final.finish_reason, final.stop_reason) == (
        inline.text, inline.token_ids, "stop", stop)
    assert final.metrics.num_output_tokens == len(inline.token_ids)
    # The engine's own record of the request ends where the output does.
    assert request.is_finished and request.output_token_ids == inline.token_ids
    assert engine.kv.num_used_blocks == 0 and len(engine.output_processor()) == 0 and not engine.requests
    assert "".join(o.new_text for o in made) == inline.text


def test_the_output_thread_serves_what_the_engine_thread_makes(threaded: LiveServer, llm):
    client = OpenAI(base_url=threaded.base_url, api_key="unused", max_retries=0, timeout=120)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = llm.generate(PROMPT, greedy, use_tqdm=False)[0]
    base = {"model": threaded.model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**base, logprobs=2)
    assert whole.choices[0].text == reference.text and whole.choices[0].finish_reason == "length"
    assert len(whole.choices[0].logprobs.tokens) == 24
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**base, stream=True)
                       if chunk.choices)
    assert streamed == reference.text
    stop = reference.text[5:8]
    stopped = client.completions.create(**base, stop=[stop])
    assert stopped.choices[0].text == reference.text[:reference.text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    stopped_stream = list(client.completions.create(**base, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in stopped_stream if c.choices) == stopped.choices[0].text
    assert threaded.wait_idle()["nanoserve_kv_blocks_used"] == 0


def test_a_client_that_goes_away_frees_its_request(threaded: LiveServer):
    body = {"model": threaded.model, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", threaded.url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break  # one token, then hang up
    assert threaded.wait_idle()["nanoserve_kv_blocks_used"] == 0
    assert not leaks(threaded)


def test_an_engine_failure_is_a_500_and_the_server_recovers(threaded: LiveServer, monkeypatch):
    engine = threaded.engine.engine

    def broken():
        raise RuntimeError("simulated device failure")

    # The engine thread picks it up at its next step.
    monkeypatch.setattr(engine, "step_core" if threaded.engine.makes_outputs_on_own_thread else "step", broken)
    resp = httpx.post(threaded.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert resp.status_code == 500 and "simulated device failure" in resp.json()["error"]["message"]
    monkeypatch.undo()
    assert threaded.wait_idle()["nanoserve_kv_blocks_used"] == 0 and len(engine.output_processor()) == 0
    ok = httpx.post(threaded.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_a_failure_making_outputs_fails_those_requests_and_aborts_them(threaded: LiveServer, monkeypatch):
    if not threaded.engine.makes_outputs_on_own_thread:
        pytest.skip("on the engine's thread, a failure making outputs is an engine failure (the test above)")
    processor = threaded.engine.engine.output_processor()
    real = processor.process
    calls = []

    def broken_once(outputs):
        calls.append(len(outputs))
        if len(calls) == 1:
            raise RuntimeError("simulated detokenizer failure")
        return real(outputs)

    monkeypatch.setattr(processor, "process", broken_once)
    with httpx.stream("POST", threaded.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True,
                            "ignore_eos": True}) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
    assert events[-1] == "[DONE]" and "simulated detokenizer failure" in json.loads(events[-2])["error"]["message"]
    monkeypatch.undo()
    assert threaded.wait_idle()["nanoserve_kv_blocks_used"] == 0 and len(processor) == 0
    assert threaded.engine.is_running


def test_a_request_id_in_use_is_refused_and_the_first_stream_goes_on(llm):
    engine = AsyncEngine(llm.engine, output_thread=True)
    engine.start()

    async def run() -> tuple[str, BaseException | None]:
        first = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), request_id="x")
        head = await anext(first)
        refused = None
        try:
            async for _ in engine.generate("other", SamplingParams(max_tokens=2), request_id="x"):
                pass
        except ValueError as exc:
            refused = exc
        outs = [head] + [out async for out in first]
        return outs[-1].text, refused

    try:
        text, refused = asyncio.run(run())
    finally:
        engine.shutdown()
    assert refused is not None and "already in use" in str(refused)
    reference = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert text == reference[0].text and not llm.engine.has_unfinished_requests()


def test_shutdown_fails_the_streams_still_open(llm):
    engine = AsyncEngine(llm.engine, output_thread=True)
    engine.start()

    async def run() -> BaseException | None:
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        try:
            async for _ in stream:
                pass
        except EngineError as exc:
            return exc
        return None

    error = asyncio.run(run())
    assert error is not None and "shutting down" in str(error)
    assert not llm.engine.has_unfinished_requests() and len(llm.engine.output_processor()) == 0
