"""The OpenAI-compatible server, end to end: the embedded SmolLM2 behind a real HTTP server,
driven by the official `openai` client (sync and async) and raw `httpx`.

Outputs are checked against each other (stream vs non-stream, seeded vs re-seeded, the
tokenizer's own counts), never against wall-clock times.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from server_fixtures import LiveServer, server  # noqa: F401  (the module-scoped fixture)

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
NO_EOS = {"ignore_eos": True}  # vLLM extension: run to max_tokens


@pytest.fixture(scope="module")
def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _async_client(server: LiveServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _chat_prompt_tokens(server: LiveServer, messages) -> int:
    tok = server.tokenizer
    return len(tok.encode(tok.apply_chat_template(messages), add_special_tokens=False))


def test_health_and_models(server: LiveServer, client: OpenAI):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].object == "model"
    assert client.models.retrieve(server.model).id == server.model


def test_completion_usage_and_stream_agree(server: LiveServer, client: OpenAI):
    full = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body=NO_EOS)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert full.usage.prompt_tokens == len(server.tokenizer.encode(PROMPT))
    assert full.usage.completion_tokens == 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8

    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                            extra_body=NO_EOS, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completion_token_ids_prompt(server: LiveServer, client: OpenAI):
    ids = server.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(model=server.model, prompt=[PROMPT], max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_paris_and_stream(server: LiveServer, client: OpenAI):
    resp = client.chat.completions.create(model=server.model, messages=CAPITAL, max_tokens=24, temperature=0)
    assert resp.object == "chat.completion"
    message = resp.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content
    assert resp.usage.prompt_tokens == _chat_prompt_tokens(server, CAPITAL)
    assert resp.usage.completion_tokens >= 1

    chunks = list(client.chat.completions.create(model=server.model, messages=CAPITAL, max_tokens=24,
                                                 temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == resp.choices[0].finish_reason
    assert chunks[-1].choices[0].delta.content is None  # the final chunk only carries the reason


def test_include_usage(server: LiveServer, client: OpenAI):
    reference = client.chat.completions.create(model=server.model, messages=CAPITAL, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model=server.model, messages=CAPITAL, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump(exclude_none=True) == reference.usage.model_dump(exclude_none=True)
    assert all(c.usage is None for c in chunks[:-1])

    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == len(server.tokenizer.encode(PROMPT))


def test_n_choices(server: LiveServer, client: OpenAI):
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, n=2,
                                     extra_body=NO_EOS)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in resp.choices)
    assert resp.usage.prompt_tokens == len(server.tokenizer.encode(PROMPT))  # counted once, as OpenAI does
    assert resp.usage.completion_tokens == 12
    again = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, n=2,
                                      extra_body=NO_EOS)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seed + index per choice

    chunks = list(client.chat.completions.create(model=server.model, messages=CAPITAL, max_tokens=6, n=2,
                                                 stream=True))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert set(finished) == {0, 1}
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


def test_stop_strings(server: LiveServer, client: OpenAI):
    free = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body=NO_EOS).choices[0].text
    words = free.split()
    assert len(words) >= 2, free
    stop = words[1]
    expected = free[:free.find(stop)]
    for stops in (stop, [stop, "\u2603 never"]):
        choice = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                           stop=stops, extra_body=NO_EOS).choices[0]
        assert choice.text == expected and choice.finish_reason == "stop"
        assert choice.model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                              stop=stop, extra_body=NO_EOS, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"

    chat = client.chat.completions.create(model=server.model, messages=CAPITAL, max_tokens=24, temperature=0,
                                          stop=["Paris"])
    assert "Paris" not in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"


def test_completion_logprobs(server: LiveServer, client: OpenAI):
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                     extra_body=NO_EOS)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) >= 2
        assert top[token] == pytest.approx(max(top.values()))  # greedy picks the top token

    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                            logprobs=2, extra_body=NO_EOS, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs(server: LiveServer, client: OpenAI):
    resp = client.chat.completions.create(model=server.model, messages=CAPITAL, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert bytes(entry.bytes).decode("utf-8", errors="replace")  # bytes are a valid list of ints
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert text.startswith(resp.choices[0].message.content)

    plain = client.chat.completions.create(model=server.model, messages=CAPITAL, max_tokens=3, temperature=0,
                                           logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_seed_reproducible(server: LiveServer, client: OpenAI):
    def sample(seed: int) -> str:
        return client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=16,
                                         temperature=1.0, seed=seed, extra_body=NO_EOS).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) > 1  # 16 tokens at temperature 1: seeds matter


def test_concurrent_async_clients(server: LiveServer):
    questions = ["What is the capital of France?", "Name a color.", "What is 2 + 2?", "Say hello.",
                 "Name a fruit.", "What is the opposite of hot?"]

    async def main():
        async with _async_client(server) as aclient:
            async def chat(q: str):
                return await aclient.chat.completions.create(
                    model=server.model, messages=[{"role": "user", "content": q}], max_tokens=12, temperature=0)

            async def streamed(q: str) -> int:
                stream = await aclient.completions.create(
                    model=server.model, prompt=q, max_tokens=8, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body=NO_EOS)
                chunks = [c async for c in stream]
                return chunks[-1].usage.completion_tokens

            return await asyncio.gather(*(chat(q) for q in questions), *(streamed(q) for q in questions[:2]))

    results = asyncio.run(main())
    chats = results[:len(questions)]
    for q, r in zip(questions, chats):
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens == _chat_prompt_tokens(server, [{"role": "user", "content": q}])
    assert "Paris" in chats[0].choices[0].message.content
    assert results[len(questions):] == [8, 8]
    assert server.wait_idle()["nanoserve_kv_blocks_used"] == 0


def test_sdk_raises_typed_errors(server: LiveServer, client: OpenAI):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.body["type"] == "not_found_error" and "`gpt-4` does not exist" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt="hi", max_tokens=5000)
    assert "2048" in err.value.body["message"]


def test_client_disconnect_mid_stream_frees_kv(server: LiveServer):
    body = {"model": server.model, "prompt": "Write a long story about a dragon.", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    before = server.metrics()
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: dropping a half-read iterator closes the connection
            first = next(lines)
            assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
            # The stats snapshot may lag the first chunk by a step: poll.
            assert server.wait_until(lambda m: m["nanoserve_kv_blocks_used"] > 0)  # it really is generating
            assert any(next(lines).startswith("data: ") for _ in range(4))  # ... and still streaming
        # leaving the block closes the connection mid-stream
    after = server.wait_idle()
    assert after["nanoserve_kv_blocks_used"] == 0
    assert after["nanoserve_requests_finished_total"] == before["nanoserve_requests_finished_total"] + 1
    generated = after["nanoserve:generation_tokens_total"] - before["nanoserve:generation_tokens_total"]
    assert generated < 1500  # it was aborted, not run to the end


def test_client_disconnect_non_stream_frees_kv(server: LiveServer):
    body = {"model": server.model, "prompt": "Write a long story about a dragon.", "max_tokens": 1500,
            "ignore_eos": True}
    before = server.metrics()["nanoserve_requests_finished_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    after = server.wait_idle()
    assert after["nanoserve_kv_blocks_used"] == 0
    assert after["nanoserve_requests_finished_total"] == before + 1


def test_priority_field_sets_the_request_class(server: LiveServer, client: OpenAI):
    before = server.engine.stats().per_class["offline"]["finished"]
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3,
                                    extra_body={"priority": "offline", **NO_EOS})
    assert out.usage.completion_tokens == 3
    # The engine publishes stats after each step, so they may lag the response by a moment.
    assert server.wait_until(lambda _: server.engine.stats().per_class["offline"]["finished"] == before + 1)
    text = httpx.get(server.url + "/metrics").text
    assert 'nanoserve_slo_attainment_ratio{model_name="' in text and 'priority="offline"} 1' in text


def test_slo_field_sets_the_request_targets(server: LiveServer, client: OpenAI):
    def attained() -> tuple[int, int]:
        summary = server.engine.stats().per_class["online"]
        return summary["finished"], round(summary["finished"] * (summary["slo_attainment"] or 0))

    def ask(slo: dict) -> None:
        out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3,
                                        extra_body={"slo": slo, **NO_EOS})
        assert out.usage.completion_tokens == 3

    for slo, met in (({"ttft": 1e-9}, 0), ({"ttft": 600.0, "tpot": 600.0}, 1)):  # unattainable, then certain
        finished, met_before = attained()
        ask(slo)
        assert server.wait_until(lambda _: attained()[0] == finished + 1)
        assert attained()[1] == met_before + met


def test_metrics_format(server: LiveServer):
    resp = httpx.get(server.url + "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    for name, kind in [("nanoserve:num_requests_running", "gauge"), ("nanoserve:num_requests_waiting", "gauge"),
                       ("nanoserve_kv_blocks_used", "gauge"), ("nanoserve_kv_blocks_total", "gauge"),
                       ("nanoserve:generation_tokens_total", "counter"), ("nanoserve:prompt_tokens_total", "counter"),
                       ("nanoserve_requests_finished_total", "counter"), ("nanoserve:num_preemptions_total", "counter"),
                       ("nanoserve_time_to_first_token_seconds", "histogram")]:
        assert f"# TYPE {name} {kind}\n" in text and f"# HELP {name} " in text
    m = server.metrics()
    assert m["nanoserve_kv_blocks_total"] == 8192 // 16
    assert m["nanoserve:generation_tokens_total"] > 0 and m["nanoserve:prompt_tokens_total"] > 0
    assert m["nanoserve_step_seconds_total"] > 0 and m["nanoserve_predicted_step_seconds_total"] > 0


def test_prefix_cache_usage_metrics_and_reset(server: LiveServer, client: OpenAI):
    """A prompt that repeats an earlier one's first 80 tokens (5 blocks of 16) finds them cached,
    says so in OpenAI's usage (streamed too), counts them in /metrics, and after
    POST /reset_prefix_cache finds nothing."""
    server.wait_idle()
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    before = server.metrics()
    shared = list(range(1000, 1080))
    first = client.completions.create(model=server.model, prompt=shared + [7], max_tokens=2, temperature=0)
    second = client.completions.create(model=server.model, prompt=shared + [8, 9], max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 80
    stream = client.completions.create(model=server.model, prompt=shared + [10], max_tokens=2, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == 80
    after = server.metrics()
    queries, hits = "nanoserve:prefix_cache_queries_total", "nanoserve:prefix_cache_hits_total"
    assert after[queries] - before[queries] == 81 + 82 + 81 and after[hits] - before[hits] == 160
    assert 0 < after["nanoserve_prefix_cache_hit_ratio"] <= 1
    assert after["nanoserve_prefix_cache_host_hits_total"] == 0  # no host tier here
    reset = httpx.post(server.url + "/reset_prefix_cache").json()
    assert reset["blocks_forgotten"] >= 5
    again = client.completions.create(model=server.model, prompt=shared + [8, 9], max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].text == second.choices[0].text
    chats = [client.chat.completions.create(model=server.model, messages=CAPITAL, max_tokens=2, temperature=0)
             for _ in range(2)]
    assert chats[0].usage.prompt_tokens_details.cached_tokens == 0
    assert chats[1].usage.prompt_tokens_details.cached_tokens == (chats[1].usage.prompt_tokens - 1) // 16 * 16


def test_zz_no_leaks_at_end(server: LiveServer, client: OpenAI):
    assert server.wait_idle()["nanoserve_kv_blocks_used"] == 0
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_stopped_server_lets_go_of_its_model():
    """FastAPI keeps endpoint functions in a process-wide cache, and ours close over the engine:
    without the engine's shutdown freeing its executor, every server a process starts would keep
    its model and KV cache (the suite's server tests reached 24 GB)."""
    import gc
    import weakref

    from server_fixtures import live_server

    with live_server() as live:
        assert httpx.post(live.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                          timeout=60).status_code == 200
        model = weakref.ref(live.engine.engine.executor.model)
    del live
    gc.collect()
    assert model() is None
