"""KunServe's cluster behind the OpenAI server (`nanoserve serve --instances N [--drop]`:
nanoserve/cluster/cluster_engine.py, the `ServingEngine` the server's loop drives).

One module-wide server over two instances of a tiny random-weight Llama with a byte-level
tokenizer and small KV pools (8 blocks each), so that a burst throttles them and they drop; one
single-engine server of the same model is the reference. Greedy answers must be the single
engine's (in a drop too: the near-tie rule), a client that leaves must free its KV on the
instance that held it, and /metrics must show the cluster's gauges.
"""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
from conftest import build_tiny_model, write_byte_tokenizer
from server_fixtures import LiveServer, live_server, near_tie_equal

from nanoserve.cli import main
from nanoserve.cluster.cluster_engine import ClusterEngine

BLOCK = 16
BYTE_VOCAB = 259  # conftest.write_byte_tokenizer's 256 bytes and 3 special tokens
POOL_TOKENS = 8 * BLOCK  # per instance: also the longest request (prompt + max_tokens)
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
ENGINE = dict(dtype="float32", block_size=BLOCK, kv_cache_tokens=POOL_TOKENS, max_model_len=POOL_TOKENS,
              chat_template=CHAT_TEMPLATE)
DEADLINE_S = 120  # hang guards, not speed assertions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("server-cluster-llama")
    build_tiny_model("llama", directory, vocab_size=BYTE_VOCAB)  # every id it draws has a token's text
    write_byte_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def single(model_dir):
    with live_server(model=str(model_dir), **ENGINE) as live:
        yield live


@pytest.fixture(scope="module", params=["lockstep", "group_lockstep"])
def cluster(model_dir, request):
    """The cluster behind the server, stepped in lockstep and with the asynchronous front."""
    with live_server(make_engine=partial(ClusterEngine.start, num_instances=2, drop=True, stepping=request.param),
                     model=str(model_dir), **ENGINE) as live:
        yield live
        settled = wait_for(live, lambda m: value(m, "nanoserve_kv_blocks_used") == 0
                           and value(m, "nanoserve_cluster_instances_in_pipelines") == 0)
        assert settled, "the cluster kept KV blocks or dropped layers after its requests"
        assert live.engine.is_running, f"the engine thread died: {live.engine.last_error}"


# -- /metrics, labels included ---------------------------------------------------------------
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)$")


def scrape(live: LiveServer) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in httpx.get(live.url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            match = _LINE.match(line)
            assert match, f"malformed metrics line: {line!r}"
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            out.append((match.group(1), labels, float(match.group(3))))
    return out


def value(samples, name: str, **labels: str) -> float | None:
    """The one series of `name` with `labels` (among others), or None if there is none."""
    found = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
    assert len(found) <= 1, f"{name}{labels}: {len(found)} series"
    return found[0] if found else None


def wait_for(live: LiveServer, condition, timeout: float = DEADLINE_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition(scrape(live)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def complete(live: LiveServer, prompt, **body) -> dict:
    reply = httpx.post(live.base_url + "/completions", json={"prompt": prompt, "temperature": 0, **body},
                       timeout=DEADLINE_S)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream_chat(live: LiveServer, messages: list[dict], **body) -> str:
    text = ""
    with httpx.stream("POST", live.base_url + "/chat/completions", timeout=DEADLINE_S,
                      json={"messages": messages, "temperature": 0, "stream": True, **body}) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    return text


# -- tests -----------------------------------------------------------------------------------
def test_completions_and_a_streamed_chat_answer_as_one_engine(single, cluster):
    for prompt in ("The quick brown fox", [5, 6, 7, 8, 9, 10]):
        ref = complete(single, prompt, max_tokens=12, ignore_eos=True, logprobs=5)["choices"][0]
        out = complete(cluster, prompt, max_tokens=12, ignore_eos=True, logprobs=5)["choices"][0]
        assert out["text"] == ref["text"] and out["logprobs"]["tokens"] == ref["logprobs"]["tokens"], prompt
    messages = [{"role": "user", "content": "Hi there"}]
    ref = httpx.post(single.base_url + "/chat/completions", timeout=DEADLINE_S,
                     json={"messages": messages, "temperature": 0, "max_tokens": 10}).json()
    assert stream_chat(cluster, messages, max_tokens=10) == ref["choices"][0]["message"]["content"]
    # One engine's server has no cluster metrics; the cluster's has them.
    assert not [n for n, _, _ in scrape(single) if n.startswith("nanoserve_cluster_")]
    assert value(scrape(cluster), "nanoserve_cluster_instances") == 2


def test_a_client_that_leaves_frees_its_kv_on_its_instance(cluster):
    max_tokens = POOL_TOKENS - 8  # would run ~120 steps if the abort did not reach the instance
    before = scrape(cluster)
    with httpx.stream("POST", cluster.base_url + "/completions", timeout=DEADLINE_S,
                      json={"prompt": [11, 12, 13, 14], "max_tokens": max_tokens, "ignore_eos": True,
                            "stream": True}) as reply:
        assert reply.status_code == 200
        chunks = reply.iter_lines()
        assert next(line for line in chunks if line.startswith("data: "))  # it is running
        held = scrape(cluster)
    # Closed mid-stream. The instance that held it aborts it and frees its blocks.
    assert wait_for(cluster, lambda m: value(m, "nanoserve_kv_blocks_used") == 0
                    and value(m, "nanoserve:num_requests_running") == 0)
    after = scrape(cluster)
    generated = value(after, "nanoserve:generation_tokens_total") - value(before, "nanoserve:generation_tokens_total")
    assert 1 <= generated < max_tokens, generated
    assert value(after, "nanoserve_requests_finished_total") == value(before, "nanoserve_requests_finished_total") + 1
    assert sum(value(after, "nanoserve_cluster_instance_kv_blocks_used", instance=str(i)) for i in (0, 1)) == 0
    assert value(held, "nanoserve_kv_blocks_used") >= 1  # what it held while it ran


def test_a_burst_drops_layers_answers_as_one_engine_and_restores(single, cluster):
    """Eight 40-token prompts into two pools of 8 blocks: each instance gets four that need
    4 blocks each; the queued ones throttle them, the pair drops, and once the burst is served
    the cluster restores. Answers: the single engine's, near ties aside."""
    prompts = [[20 + i] * 40 for i in range(8)]
    body = dict(max_tokens=20, ignore_eos=True, logprobs=5)
    refs = [complete(single, p, **body)["choices"][0]["logprobs"] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: complete(cluster, p, **body), prompts))
    for prompt, ref, out in zip(prompts, refs, outs):
        choice = out["choices"][0]
        assert out["usage"]["completion_tokens"] == 20
        assert near_tie_equal(ref, choice["logprobs"]), prompt[0]
    metrics = scrape(cluster)
    assert value(metrics, "nanoserve_cluster_layout_changes_total", kind="drop") >= 1
    assert value(metrics, "nanoserve_cluster_throttled_steps_total") >= 1
    for instance in ("0", "1"):  # per instance: its pool (a drop enlarges it) and what is in use
        assert value(metrics, "nanoserve_cluster_instance_kv_blocks_total", instance=instance) >= 8
        assert 0 <= value(metrics, "nanoserve_cluster_instance_kv_usage_perc", instance=instance) <= 1
        assert value(metrics, "nanoserve_cluster_instance_requests", instance=instance, state="waiting") is not None
    assert value(metrics, "nanoserve_cluster_throttled_instances") is not None
    # Idle, the pair splits back into replicas of their full pools.
    assert wait_for(cluster, lambda m: value(m, "nanoserve_cluster_layout_changes_total", kind="restore") >= 1
                    and value(m, "nanoserve_cluster_instances_in_pipelines") == 0
                    and value(m, "nanoserve_cluster_instance_kv_blocks_total", instance="0") == 8)


@pytest.mark.parametrize("argv, message", [
    (["--drop"], "--drop needs --instances 2 or more"),
    (["--instances", "1", "--drop"], "--drop needs --instances 2 or more"),
    (["--instances", "0"], "--instances must be at least 1"),
    (["--cluster-stepping", "group_lockstep"], "--cluster-stepping group_lockstep needs --instances 2 or more"),
    (["--instances", "2", "--tp", "2"], "does not combine with --tp or --pp"),
    (["--instances", "2", "--async-pipeline"], "--async-pipeline with --instances keeps a drop's pipeline"),
])
def test_a_cluster_the_flags_cannot_make_is_refused_before_anything_loads(argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["serve", "--model", "/nonexistent", *argv])
