"""SIGTERM drains: the server stops taking new work (new connections are refused, requests on
open ones get 503, /health fails), lets the requests in flight finish, persists its batches and
exits 0. Without it, a rolling restart would cut every stream in flight.
"""
from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from serve_process import Serve, require_embedded_model

pytestmark = pytest.mark.slow


def test_sigterm_lets_streams_in_flight_finish_then_exits_cleanly(tmp_path):
    require_embedded_model()
    serve = Serve(tmp_path / "serve.log", "--state-dir", str(tmp_path / "state"), "--shutdown-timeout", "120")
    events: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"prompt": "Write a long story about the sea.", "max_tokens": 48, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=300) as reply:
            for line in reply.iter_lines():
                if line:
                    events.append(line.removeprefix("data: "))
                    first_chunk.set()

    try:
        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(120), serve.tail()
        serve.signal(signal.SIGTERM)  # mid-stream
        reader.join(300)
        assert not reader.is_alive()
        rc = serve.wait(120)
    finally:
        serve.kill()
    assert rc == 0, serve.tail()
    assert events[-1] == "[DONE]", events[-3:]
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 48  # the whole stream, not cut at the signal
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2]]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    assert "draining" in serve.tail()
    with pytest.raises(httpx.ConnectError):  # gone: nothing listens any more
        httpx.get(serve.url + "/health", timeout=5)
