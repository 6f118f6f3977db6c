"""A real nanoserve HTTP server for the server tests: the embedded SmolLM2 behind uvicorn, on a
free port, in a background thread of the test process.

A thread (not a subprocess) so that tests can also look at the engine directly (its tokenizer,
its stats); the server still speaks real HTTP on a real socket, so the official `openai` client
and raw `httpx` see exactly what any client would.
"""
from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from nanoserve.async_engine import AsyncEngine
from nanoserve.builder import build_engine
from nanoserve.config import EngineArgs
from nanoserve.server import create_app
from nanoserve.serving import ServingEngine

MAX_MODEL_LEN = 2048
KV_CACHE_TOKENS = 8192
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    engine: AsyncEngine
    app: Any = None  # the FastAPI app (app.state.server, app.state.batches)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def model(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def metrics(self) -> dict[str, float]:
        """Scrape /metrics: metric name -> value (for metrics with one series)."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                match = _SAMPLE.match(line)
                assert match, f"malformed metrics line: {line!r}"
                values[match.group(1)] = float(match.group(3))
        return values

    def wait_until(self, condition: Callable[[dict[str, float]], bool], timeout: float = 60.0) -> bool:
        """Poll /metrics until `condition(scrape)` holds. A poll with a generous timeout, never a
        timing assertion: the engine publishes its stats after each step, so they may lag."""
        deadline = time.monotonic() + timeout
        while not condition(self.metrics()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Wait until no request holds KV blocks or is queued; return the last scrape."""
        self.wait_until(lambda m: m["nanoserve_kv_blocks_used"] == 0 and m["nanoserve:num_requests_running"] == 0
                        and m["nanoserve:num_requests_waiting"] == 0, timeout)
        return self.metrics()


def near_tie_equal(ref: dict, out: dict) -> bool:
    """Two completions' `logprobs` (token strings and top-5 dicts) hold the same greedy tokens,
    or, from the first difference on, a near tie: each side's token in the other's top 5, since
    batched arithmetic may round a near tie the other way (vLLM's rule; test_invariance's on ids)."""
    for i, (a, b) in enumerate(zip(ref["tokens"], out["tokens"])):
        if a != b:
            return a in out["top_logprobs"][i] and b in ref["top_logprobs"][i]
    return len(ref["tokens"]) == len(out["tokens"])


def leaks(live: LiveServer) -> list[str]:
    """What an idle server still holds: KV blocks, host KV blocks (checkpoints, swaps), blocks a
    peer hosts, requests. Read while the engine thread is idle (after `wait_idle`)."""
    engine, found = live.engine.engine, []
    if engine.requests:
        found.append(f"{len(engine.requests)} requests still in the engine")
    if engine.kv.num_used_blocks:
        found.append(f"{engine.kv.num_used_blocks} KV blocks used")
    host = getattr(engine.executor, "host_store", None)
    if host is not None and host.num_free_blocks != host.num_blocks:
        found.append(f"{host.num_blocks - host.num_free_blocks} host KV blocks held")
    arena = getattr(engine.executor, "arena", None)
    if arena is not None and arena.num_used_blocks:
        found.append(f"{arena.num_used_blocks} arena blocks held")
    engine.kv.check_invariants()
    return found


@contextlib.contextmanager
def live_server(app_kwargs: dict | None = None, make_engine: Callable[[EngineArgs], ServingEngine] = build_engine,
                **engine_kwargs) -> Iterator[LiveServer]:
    """Build the engine, serve it on a free port, and stop everything on exit. `app_kwargs` go
    to `create_app` (max_queued, request_timeout, state_dir); `make_engine` builds the engine
    from the EngineArgs (default: one `Engine`; a cluster's front, test_server_cluster.py)."""
    args = EngineArgs(**{"device": "cpu", "kv_cache_tokens": KV_CACHE_TOKENS, "max_model_len": MAX_MODEL_LEN,
                         **engine_kwargs})
    engine = AsyncEngine.build(lambda: make_engine(args), output_thread=args.output_thread)
    app = create_app(engine, **(app_kwargs or {}))  # its lifespan starts and stops the engine thread
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # bound here, so no other process can take the port meanwhile
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", engine, app)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        engine.shutdown()
        engine.engine.shutdown()  # frees the model and KV: FastAPI's endpoint cache keeps the app's closures


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    """One server per test module. On teardown, no request may still hold KV memory."""
    with live_server() as live:
        yield live
        final = live.wait_idle()
        assert final["nanoserve_kv_blocks_used"] == 0, "KV blocks leaked by the module's requests"
        assert live.engine.is_running, f"the engine thread died: {live.engine.last_error}"
