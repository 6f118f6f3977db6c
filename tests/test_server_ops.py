"""The server as operators run it: API keys, CORS, request ids, /tokenize /detokenize /version,
served model names and a chat template of the operator's (issue 44), with a live server."""
from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from openai import OpenAI
from server_fixtures import live_server

from nanoserve import LLM, SamplingParams, __version__

KEYS = ["key-one", "key-two"]
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def guarded():
    app_kwargs = {"api_keys": KEYS, "served_model_name": ["smol", "gpt-4o-mini"]}
    with live_server(app_kwargs, chat_template=TEMPLATE) as live:
        yield live


def test_api_keys_guard_the_v1_routes(guarded):
    body = {"model": "smol", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-one"}):
        response = httpx.post(guarded.base_url + "/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and "Bearer" in error["message"]
    for key in KEYS:  # either key (rotation)
        response = httpx.post(guarded.base_url + "/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                              timeout=60)
        assert response.status_code == 200, response.text
    assert httpx.get(guarded.base_url + "/models", timeout=30).status_code == 401
    for path in ("/health", "/metrics", "/version"):  # open, as in vLLM
        assert httpx.get(guarded.url + path, timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=guarded.base_url, api_key="wrong", max_retries=0).models.list()
    models = OpenAI(base_url=guarded.base_url, api_key=KEYS[1], max_retries=0).models.list()
    assert [m.id for m in models.data] == ["smol"]


def test_served_model_names_are_aliases(guarded):
    client = OpenAI(base_url=guarded.base_url, api_key=KEYS[0], max_retries=0, timeout=60)
    out = client.completions.create(model="gpt-4o-mini", prompt="hi", max_tokens=2)
    assert out.model == "smol"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)


def test_cors_preflight_and_response_headers(guarded):
    preflight = httpx.options(guarded.base_url + "/chat/completions", timeout=30, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    response = httpx.get(guarded.url + "/health", headers={"Origin": "https://app.example"}, timeout=30)
    assert response.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in response.headers["access-control-expose-headers"].lower()


def test_request_ids_in_and_out_and_in_the_log(guarded, caplog):
    headers = {"Authorization": f"Bearer {KEYS[0]}", "X-Request-Id": "trace-abc-123"}
    with caplog.at_level(logging.INFO, logger="nanoserve.requests"):
        logger = logging.getLogger("nanoserve.requests")
        logger.addHandler(caplog.handler)
        try:
            response = httpx.post(guarded.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2},
                                  headers=headers, timeout=60)
        finally:
            logger.removeHandler(caplog.handler)
    assert response.headers["x-request-id"] == "trace-abc-123"
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "nanoserve.requests"]
    assert any(line["request_id"] == "trace-abc-123" for line in lines)
    made = httpx.get(guarded.url + "/health", timeout=30).headers["x-request-id"]
    assert len(made) == 32 and made != httpx.get(guarded.url + "/health", timeout=30).headers["x-request-id"]
    refused = httpx.post(guarded.base_url + "/completions", json={}, headers={"X-Request-Id": "t2"}, timeout=30)
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "t2"  # errors carry it too


def test_tokenize_detokenize_and_version(guarded):
    tok = guarded.tokenizer
    text = "The capital of France is Paris."
    response = httpx.post(guarded.url + "/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=30)
    body = response.json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == guarded.engine.max_model_len
    assert body["token_strs"] == [tok.token_to_str(t) for t in body["tokens"]]
    back = httpx.post(guarded.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()
    assert back["prompt"] == text
    chat = httpx.post(guarded.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      timeout=30).json()
    assert tok.decode(chat["tokens"], skip_special_tokens=False) == "[user] hi\n[assistant]"  # the operator's template
    assert httpx.post(guarded.url + "/detokenize", json={"tokens": [10 ** 9]}, timeout=30).status_code == 400
    assert httpx.post(guarded.url + "/tokenize", json={"prompt": "a", "messages": []}, timeout=30).status_code == 400
    assert httpx.get(guarded.url + "/version", timeout=30).json() == {"version": __version__}


def test_the_operators_chat_template_is_used_for_chat(guarded):
    client = OpenAI(base_url=guarded.base_url, api_key=KEYS[0], max_retries=0, timeout=60)
    out = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    expected = len(guarded.tokenizer.encode("[user] hi\n[assistant]", add_special_tokens=False))
    assert out.usage.prompt_tokens == expected


def test_chat_template_offline_and_a_missing_file(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    llm = LLM(device="cpu", kv_cache_tokens=1024, chat_template=str(path))
    out = llm.chat([{"role": "user", "content": "yo"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) == "[user] yo\n[assistant]"
    with pytest.raises(ValueError, match="no such file"):
        LLM(device="cpu", kv_cache_tokens=1024, chat_template=str(tmp_path / "missing.jinja"))


def test_the_stats_line():
    from nanoserve.engine import EngineStats
    from nanoserve.server.stats_log import StatsLogger

    now = [100.0]
    stats_log = StatsLogger(5.0, clock=lambda: now[0])

    def stats(prompt, generated, running, waiting, used=0, queries=0, hits=0):
        return EngineStats(num_running=running, num_waiting=waiting, kv_blocks_used=used, kv_blocks_total=200,
                           num_preemptions=0, prompt_tokens_total=prompt, generation_tokens_total=generated,
                           requests_finished_total=0, kv_events={"prefix_cache_queries": queries,
                                                                 "prefix_cache_hits": hits})

    assert stats_log.line(stats(0, 0, 0, 0)) is None  # the first snapshot only starts the clock
    now[0] += 5
    assert stats_log.line(stats(0, 0, 0, 0)) is None  # idle: nothing to say
    now[0] += 5
    line = stats_log.line(stats(400, 50, 3, 2, used=50, queries=400, hits=100))
    assert line == ("Engine: avg prompt throughput 80.0 tokens/s, avg generation throughput 10.0 tokens/s, "
                    "running 3 reqs, waiting 2 reqs, KV cache usage 25.0%, prefix cache hit rate 25.0%")


def test_the_server_logs_stats_while_it_works(caplog):
    with caplog.at_level(logging.INFO, logger="nanoserve.stats"):
        with live_server({"log_stats_interval": 0.2}) as live:
            httpx.post(live.base_url + "/completions", json={"prompt": "hi", "max_tokens": 40, "ignore_eos": True},
                       timeout=60)
            import time
            time.sleep(0.5)
    assert any(r.getMessage().startswith("Engine: avg prompt throughput") for r in caplog.records)


def test_every_metric_the_dashboard_queries_exists(tmp_path):
    """docs/grafana/nanoserve.json asks only for series /metrics serves (after one request)."""
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parents[1] / "docs" / "grafana" / "nanoserve.json").read_text())
    wanted = {re.sub(r"_(bucket|sum|count)$", "", name)
              for panel in dashboard["panels"] for target in panel["targets"]
              for name in re.findall(r"nanoserve[:_][A-Za-z0-9_:]*", target["expr"])}
    wanted.add("nanoserve:num_requests_running")  # the model_name variable's query
    with live_server() as live:
        httpx.post(live.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        text = httpx.get(live.url + "/metrics", timeout=30).text
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    served |= {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}  # labelled, none yet
    served |= {re.sub(r"_(bucket|sum|count)$", "", name) for name in served}
    assert len(wanted) > 20 and wanted <= served, sorted(wanted - served)


def test_bodies_over_the_limit_get_413_and_uploads_keep_their_own_limit():
    with live_server({"max_body_bytes": 2048}) as live:
        url = live.base_url + "/completions"
        big = {"prompt": "x " * 2000, "max_tokens": 1}
        response = httpx.post(url, json=big, timeout=30)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            body = json.dumps(big).encode()
            for i in range(0, len(body), 512):
                yield body[i:i + 512]

        assert httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"},
                          timeout=30).status_code == 413
        assert httpx.post(url, json={"prompt": "hi", "max_tokens": 1}, timeout=60).status_code == 200
        line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "y" * 3000, "max_tokens": 1}})
        upload = httpx.post(live.base_url + "/files", files={"file": ("b.jsonl", line.encode())},
                            data={"purpose": "batch"}, timeout=30)
        assert upload.status_code == 200, upload.text


def test_a_queued_stream_gets_keepalive_comments():
    """With one sequence at a time, a second streamed request waits behind the first: its stream
    sends SSE comments meanwhile, which the official client skips."""
    import threading

    with live_server({"sse_keepalive": 0.1}, max_num_seqs=1) as live:
        blocker = threading.Thread(target=httpx.post, args=(live.base_url + "/completions",),
                                   kwargs={"json": {"prompt": "hi", "max_tokens": 120, "ignore_eos": True},
                                           "timeout": 120})
        blocker.start()
        import time
        time.sleep(0.3)
        lines = []
        with httpx.stream("POST", live.base_url + "/completions", timeout=120,
                          json={"prompt": "hello", "max_tokens": 2, "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line]
        blocker.join()
        assert ": keep-alive" in lines and lines[-1] == "data: [DONE]"
        assert lines.index(": keep-alive") < next(i for i, x in enumerate(lines) if x.startswith("data: {"))
        client = OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)
        text = "".join(c.choices[0].text for c in client.completions.create(model=live.model, prompt="hi",
                                                                              max_tokens=3, stream=True) if c.choices)
        assert text
