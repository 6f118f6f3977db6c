"""`examples/serve.py` as a real process, for the tests that signal or kill it (SIGTERM, SIGKILL):
a thread in the test process cannot be killed, and uvicorn's signal handling only runs in a
process's main thread."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]


def require_embedded_model() -> None:
    """serve.py's default model, converted once (cached) so that a start only loads it."""
    from nanoserve import default_model

    try:
        default_model()
    except FileNotFoundError as exc:
        pytest.skip(f"the embedded SmolLM2 is not installed: {exc}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Serve:
    """examples/serve.py in its own process, logging to a file; up once /health answers."""

    def __init__(self, log_path: Path, *extra: str, ready_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "serve.py"), "--port", str(self.port), "--device", "cpu",
             "--kv-cache-tokens", "8192", "--max-model-len", "2048", *extra],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + ready_timeout
        while True:
            assert self.proc.poll() is None, f"serve.py exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"serve.py did not come up in {ready_timeout:g} s:\n{self.tail()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.client = OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(30)
