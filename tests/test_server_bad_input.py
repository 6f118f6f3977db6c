"""Bad input never hurts the server: every client mistake gets a 4xx with an OpenAI-shaped error
body that names the problem, nothing reaches the engine, and the next request is served.

Raw `httpx` is used (not the `openai` client) so that malformed bodies can be sent byte for byte.
"""
from __future__ import annotations

import json

import httpx
import pytest
from server_fixtures import MAX_MODEL_LEN, LiveServer, server  # noqa: F401  (the module-scoped fixture)

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (id, method, path, body: dict | bytes | None, status, error type, param, words the message must contain)
CASES = [
    ("malformed-json", "POST", COMP, b'{"prompt": "hi", "max_tokens": 3', 400, "invalid_request_error", None,
     ["not valid JSON"]),
    ("truncated-json", "POST", CHAT, b'{"messages": [{"role": "user", "cont', 400, "invalid_request_error", None,
     ["not valid JSON"]),
    ("json-garbage", "POST", COMP, b"prompt=hi&max_tokens=3", 400, "invalid_request_error", None, ["JSON"]),
    ("body-is-array", "POST", COMP, b'["hi", 3]', 400, "invalid_request_error", None, ["JSON object", "list"]),
    ("body-is-string", "POST", CHAT, b'"hello"', 400, "invalid_request_error", None, ["JSON object"]),
    ("empty-body", "POST", COMP, b"", 400, "invalid_request_error", None, ["empty"]),
    ("missing-prompt", "POST", COMP, {"max_tokens": 3}, 400, "invalid_request_error", "prompt",
     ["Missing", "prompt"]),
    ("missing-messages", "POST", CHAT, {"max_tokens": 3}, 400, "invalid_request_error", "messages",
     ["Missing", "messages"]),
    ("max-tokens-string", "POST", COMP, {"prompt": "hi", "max_tokens": "ten"}, 400, "invalid_request_error",
     "max_tokens", ["integer", "'ten'"]),
    ("max-tokens-float", "POST", COMP, {"prompt": "hi", "max_tokens": 2.5}, 400, "invalid_request_error",
     "max_tokens", ["integer"]),
    ("temperature-string", "POST", CHAT, {"messages": USER, "temperature": "hot"}, 400, "invalid_request_error",
     "temperature", ["number", "'hot'"]),
    ("temperature-nan", "POST", COMP, b'{"prompt": "hi", "temperature": NaN}', 400, "invalid_request_error",
     "temperature", ["finite"]),
    ("messages-not-list", "POST", CHAT, {"messages": "hi"}, 400, "invalid_request_error", "messages",
     ["list"]),
    ("messages-empty", "POST", CHAT, {"messages": []}, 400, "invalid_request_error", "messages", ["non-empty"]),
    ("message-without-role", "POST", CHAT, {"messages": [{"content": "hi"}]}, 400, "invalid_request_error",
     "messages[0].role", ["Missing"]),
    ("message-without-content", "POST", CHAT, {"messages": [{"role": "user"}]}, 400, "invalid_request_error",
     "messages", ["messages[0]", "content"]),
    ("message-not-object", "POST", CHAT, {"messages": ["hi"]}, 400, "invalid_request_error", "messages[0]",
     ["messages[0]"]),
    ("priority-unknown", "POST", COMP, {"prompt": "hi", "priority": "urgent"}, 400, "invalid_request_error",
     "priority", ["online", "offline"]),
    ("slo-negative", "POST", COMP, {"prompt": "hi", "slo": {"ttft": -1}}, 400, "invalid_request_error", "slo.ttft",
     ["greater than 0"]),
    ("slo-unknown-target", "POST", CHAT, {"messages": USER, "slo": {"latency": 1}}, 400, "invalid_request_error",
     "slo.latency", ["not permitted"]),
    ("slo-not-object", "POST", COMP, {"prompt": "hi", "slo": "fast"}, 400, "invalid_request_error", "slo", []),
    ("max-tokens-zero", "POST", COMP, {"prompt": "hi", "max_tokens": 0}, 400, "invalid_request_error",
     "max_tokens", ["greater than or equal to 1"]),
    ("context-overflow", "POST", COMP, {"prompt": "hi", "max_tokens": 5000}, 400, "invalid_request_error",
     "max_tokens", [str(MAX_MODEL_LEN), "maximum context length"]),
    ("prompt-too-long", "POST", COMP, {"prompt": [100] * (MAX_MODEL_LEN + 5)}, 400, "invalid_request_error",
     "prompt", [str(MAX_MODEL_LEN), "maximum context length"]),
    ("chat-context-overflow", "POST", CHAT, {"messages": USER, "max_completion_tokens": 10 ** 6}, 400,
     "invalid_request_error", "max_completion_tokens", [str(MAX_MODEL_LEN)]),
    ("temperature-negative", "POST", COMP, {"prompt": "hi", "temperature": -0.5}, 400, "invalid_request_error",
     "temperature", ["greater than or equal to 0"]),
    ("top-p-zero", "POST", COMP, {"prompt": "hi", "top_p": 0}, 400, "invalid_request_error", "top_p",
     ["greater than 0"]),
    ("top-p-above-one", "POST", CHAT, {"messages": USER, "top_p": 1.5}, 400, "invalid_request_error", "top_p",
     ["less than or equal to 1"]),
    ("top-k-negative", "POST", COMP, {"prompt": "hi", "top_k": -5}, 400, "invalid_request_error", "top_k", ["-1"]),
    ("unknown-model", "POST", COMP, {"model": "gpt-5", "prompt": "hi"}, 404, "not_found_error", "model",
     ["The model `gpt-5` does not exist."]),
    ("unknown-model-chat", "POST", CHAT, {"model": "llama-9000", "messages": USER}, 404, "not_found_error", "model",
     ["`llama-9000` does not exist"]),
    ("n-too-large", "POST", COMP, {"prompt": "hi", "n": 100}, 400, "invalid_request_error", "n", ["16"]),
    ("n-zero", "POST", CHAT, {"messages": USER, "n": 0}, 400, "invalid_request_error", "n", ["1"]),
    ("empty-prompt", "POST", COMP, {"prompt": ""}, 400, "invalid_request_error", "prompt", ["empty"]),
    ("empty-prompt-list", "POST", COMP, {"prompt": []}, 400, "invalid_request_error", "prompt", ["empty"]),
    ("prompt-wrong-type", "POST", COMP, {"prompt": {"text": "hi"}}, 400, "invalid_request_error", "prompt",
     ["string", "token ids"]),
    ("prompt-mixed-list", "POST", COMP, {"prompt": [1, "a"]}, 400, "invalid_request_error", "prompt",
     ["token ids"]),
    ("token-id-out-of-vocab", "POST", COMP, {"prompt": [1, 2, 10 ** 7]}, 400, "invalid_request_error", "prompt",
     ["token ids", "49152"]),
    ("token-id-negative", "POST", COMP, {"prompt": [-1]}, 400, "invalid_request_error", "prompt", ["token ids"]),
    ("completion-logprobs-too-many", "POST", COMP, {"prompt": "hi", "logprobs": 6}, 400, "invalid_request_error",
     "logprobs", ["5"]),
    ("completion-logprobs-bool", "POST", COMP, {"prompt": "hi", "logprobs": True}, 400, "invalid_request_error",
     "logprobs", ["integer"]),
    ("chat-top-logprobs-too-many", "POST", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 25}, 400,
     "invalid_request_error", "top_logprobs", ["20"]),
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, {"messages": USER, "top_logprobs": 2}, 400,
     "invalid_request_error", "top_logprobs", ["logprobs"]),
    ("stop-not-strings", "POST", COMP, {"prompt": "hi", "stop": [1, 2]}, 400, "invalid_request_error", "stop",
     ["stop"]),
    ("stream-not-bool", "POST", COMP, {"prompt": "hi", "stream": "yes"}, 400, "invalid_request_error", "stream",
     ["boolean"]),
    ("stream-options-without-stream", "POST", CHAT, {"messages": USER, "stream_options": {"include_usage": True}},
     400, "invalid_request_error", "stream_options", ["stream"]),
    ("seed-string", "POST", COMP, {"prompt": "hi", "seed": "abc"}, 400, "invalid_request_error", "seed",
     ["integer"]),
    ("seed-too-large", "POST", COMP, {"prompt": "hi", "seed": 2 ** 70}, 400, "invalid_request_error", "seed", []),
    ("penalty-out-of-range", "POST", CHAT, {"messages": USER, "presence_penalty": 2.5}, 400,
     "invalid_request_error", "presence_penalty", ["less than or equal to 2"]),
    ("logit-bias-key", "POST", COMP, {"prompt": "hi", "logit_bias": {"hello": 5}}, 400,
     "invalid_request_error", "logit_bias", ["token ids"]),
    ("logit-bias-value", "POST", COMP, {"prompt": "hi", "logit_bias": {"5": 500}}, 400,
     "invalid_request_error", "logit_bias.5", ["100"]),
    ("min-tokens-over-max", "POST", COMP, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400,
     "invalid_request_error", None, ["min_tokens"]),
    ("refused-field", "POST", CHAT, {"messages": USER, "audio": {"voice": "alloy"}}, 400,
     "invalid_request_error", "audio", ["not supported"]),
    ("beam-search", "POST", COMP, {"prompt": "hi", "use_beam_search": True}, 400,
     "invalid_request_error", "use_beam_search", ["not supported"]),
    ("invalid-utf8", "POST", COMP, b'{"prompt": "caf\xe9 \xff\xfe", "max_tokens": 2}', 400,
     "invalid_request_error", None, ["UTF-8"]),
    ("unknown-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "invalid_request_error", "messages[0].role", ["wizard", "assistant"]),
    ("max-tokens-negative", "POST", CHAT, {"messages": USER, "max_tokens": -5}, 400, "invalid_request_error",
     "max_tokens", ["greater than or equal to 1"]),
    ("max-tokens-huge", "POST", COMP, {"prompt": "hi", "max_tokens": 2 ** 62}, 400, "invalid_request_error",
     "max_tokens", ["maximum context length"]),
    ("timeout-zero", "POST", COMP, {"prompt": "hi", "timeout": 0}, 400, "invalid_request_error", "timeout",
     ["greater than 0"]),
    ("timeout-string", "POST", CHAT, {"messages": USER, "timeout": "soon"}, 400, "invalid_request_error", "timeout",
     []),
    ("unknown-route", "GET", "/v1/engines", None, 404, "not_found_error", None, ["/v1/engines"]),
    ("unknown-route-post", "POST", "/v1/complete", {"prompt": "hi"}, 404, "not_found_error", None,
     ["/v1/complete"]),
    ("wrong-method", "GET", COMP, None, 405, "invalid_request_error", None, ["GET"]),
    ("unknown-model-retrieve", "GET", "/v1/models/gpt-5", None, 404, "not_found_error", "model", ["gpt-5"]),
]


@pytest.fixture(scope="module")
def http(server: LiveServer):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server: LiveServer, http: httpx.Client, case):
    _, method, path, body, status, error_type, param, words = case
    before = server.metrics()
    if isinstance(body, bytes):
        resp = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = http.request(method, path, json=body)
    assert resp.status_code == status, resp.text
    payload = resp.json()
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == error_type
    assert error["param"] == param, error
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    for word in words:
        assert word in error["message"], error["message"]
    # Refused before reaching the engine: nothing was admitted.
    after = server.metrics()
    assert after["nanoserve:prompt_tokens_total"] == before["nanoserve:prompt_tokens_total"]
    assert after["nanoserve_kv_blocks_used"] == 0


def test_oversized_stream_request_gets_a_status_not_a_stream(http: httpx.Client):
    resp = http.post(COMP, json={"prompt": "hi", "max_tokens": 10 ** 6, "stream": True})
    assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/json")
    assert "maximum context length" in resp.json()["error"]["message"]


def test_errors_are_counted_in_metrics(server: LiveServer):
    text = httpx.get(server.url + "/metrics").text
    assert f'nanoserve_request_errors_total{{model_name="{server.model}",type="invalid_request_error"}}' in text
    assert 'type="not_found_error"' in text


def test_engine_failure_is_a_500_and_the_server_recovers(server: LiveServer, http: httpx.Client):
    engine = server.engine.engine
    assert server.engine.makes_outputs_on_own_thread  # the default: the engine thread runs step_core
    real_step = engine.step_core

    def broken_step():
        raise RuntimeError("simulated device failure")

    engine.step_core = broken_step  # the engine thread picks it up at its next step
    try:
        resp = http.post(COMP, json={"prompt": "hi", "max_tokens": 4})
        assert resp.status_code == 500
        error = resp.json()["error"]
        assert error["type"] == "server_error" and "simulated device failure" in error["message"]

        with http.stream("POST", CHAT, json={"messages": USER, "max_tokens": 4, "stream": True}) as stream:
            assert stream.status_code == 200  # headers were sent before the failure
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
        assert events[-1] == "[DONE]"
        assert "simulated device failure" in json.loads(events[-2])["error"]["message"]
    finally:
        engine.step_core = real_step
    assert server.wait_idle()["nanoserve_kv_blocks_used"] == 0
    assert http.get("/health").status_code == 200
    ok = http.post(COMP, json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_stopped_engine_is_a_503(server: LiveServer):
    # A second front end over the same engine whose thread was never started: everything that
    # would need the engine is refused up front, and /health says so.
    from starlette.testclient import TestClient

    from nanoserve.async_engine import AsyncEngine
    from nanoserve.server import create_app

    client = TestClient(create_app(AsyncEngine(server.engine.engine)))  # no `with`: no lifespan, no thread
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable_error"
    resp = client.post(COMP, json={"prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 503 and "not running" in resp.json()["error"]["message"]


def test_zz_server_still_serves_after_bad_input(server: LiveServer, http: httpx.Client):
    resp = http.post(CHAT, json={"model": server.model, "messages": [
        {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert http.get("/health").status_code == 200
    assert server.wait_idle()["nanoserve_kv_blocks_used"] == 0
