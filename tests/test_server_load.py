"""The server under load, for every policy: 200 concurrent streaming clients with mixed
priorities, a quarter of whom hang up mid-stream at a random point.

Every client that stays gets a complete stream in order, nothing lost or duplicated: one chunk
per generated token (each carrying its token and top-5 logprobs), exactly `MAX_TOKENS` of them,
the finish reason on the last, the usage chunk, then `[DONE]`; and its greedy tokens are the
ones its prompt gets alone, up to vLLM's near-tie rule (where batched arithmetic rounds a near
tie the other way, each side's token is in the other's top 5, and the rest may differ). After
the run the server holds nothing: no KV block, host KV block (checkpoint, swap), hosted block
or request.
"""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from server_fixtures import LiveServer, leaks, live_server, near_tie_equal

from nanoserve.sched import SCHEDULERS

CLIENTS = 200
HANG_UPS = CLIENTS // 4
MAX_TOKENS = 8
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colours are", "To make a cup of tea, first", "Water boils at",
           "The largest planet in the solar system is", "A haiku about the sea:"]


def body(prompt: str, priority: str, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 5,
            "priority": priority, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


async def one_client(http: httpx.AsyncClient, prompt: str, priority: str, hang_up_after: int | None) -> dict:
    """Stream one completion; hang up after that many chunks, if given. Returns what arrived."""
    chunks, done = [], False
    async with http.stream("POST", "/v1/completions", json=body(prompt, priority, True)) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line.removeprefix("data: ")
            assert not done, "data after [DONE]"
            if payload == "[DONE]":
                done = True
                continue
            chunks.append(json.loads(payload))
            if hang_up_after is not None and len(chunks) >= hang_up_after:
                break  # leaving the block closes the connection mid-stream
    return {"chunks": chunks, "done": done, "prompt": prompt}


async def run_load(live: LiveServer, seed: int) -> list[dict]:
    rng = random.Random(seed)
    plan = [(rng.choice(PROMPTS), rng.choice(["online", "offline"]),
             rng.randint(1, MAX_TOKENS - 1) if i < HANG_UPS else None) for i in range(CLIENTS)]
    rng.shuffle(plan)
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=CLIENTS + 10)
    async with httpx.AsyncClient(base_url=live.url, timeout=600, limits=limits) as http:
        results = await asyncio.gather(*(one_client(http, *client) for client in plan))
    return [{**r, "hung_up": hang is not None} for r, (_, _, hang) in zip(results, plan)]


def check_stream(result: dict, ref: dict) -> None:
    chunks, label = result["chunks"], result["prompt"]
    assert result["done"], f"{label}: no [DONE]"
    *tokens_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == MAX_TOKENS
    tokens, tops = [], []
    for i, chunk in enumerate(tokens_chunks):
        (choice,) = chunk["choices"]
        last = i == len(tokens_chunks) - 1
        assert choice["finish_reason"] == ("length" if last else None), f"{label}: finish_reason at chunk {i}"
        tokens += choice["logprobs"]["tokens"]
        tops += choice["logprobs"]["top_logprobs"]
    assert len(tokens) == len(ref["tokens"]) == MAX_TOKENS, f"{label}: {len(tokens)} tokens"
    assert near_tie_equal(ref, {"tokens": tokens, "top_logprobs": tops}), f"{label}: {tokens} vs {ref['tokens']}"


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(SCHEDULERS) + ["fcfs+async_scheduling"])
def test_200_streaming_clients_with_hang_ups(policy: str):
    name, _, option = policy.partition("+")
    with live_server(policy=name, max_num_seqs=64, **({option: True} if option else {})) as live:
        refs = {}
        for prompt in PROMPTS:  # alone, before the load
            reply = httpx.post(live.url + "/v1/completions", json=body(prompt, "online", False), timeout=120)
            refs[prompt] = reply.json()["choices"][0]["logprobs"]
        results = asyncio.run(run_load(live, seed=sum(map(ord, policy))))
        survivors = [r for r in results if not r["hung_up"]]
        assert len(survivors) == CLIENTS - HANG_UPS
        for result in survivors:
            check_stream(result, refs[result["prompt"]])
        final = live.wait_idle()
        assert final["nanoserve_kv_blocks_used"] == 0
        assert not leaks(live), leaks(live)
        assert live.engine.is_running, live.engine.last_error
