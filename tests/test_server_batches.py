"""The Batch API (POST /v1/files, /v1/batches) end to end with the official `openai` client, sync
and async, on the embedded SmolLM2; plus the persistence rules (exactly once across a stop and a
torn results log) on a stub server, which needs no model and no timing luck.

Outputs are checked against the same request sent to /v1/completions or /v1/chat/completions
(greedy, so they must agree), never against wall-clock times.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from server_fixtures import LiveServer, leaks, live_server

from nanoserve.server.batch_store import BatchStore, ResultLog
from nanoserve.server.batches import BatchService, CreateBatch
from nanoserve.server.errors import APIError

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "The color of the sky is",
           "Water boils at", "My favourite fruit is"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    """One server per module, with its batch state in a temporary directory; on teardown no
    request may still hold KV memory."""
    with live_server(app_kwargs={"state_dir": tmp_path_factory.mktemp("state")}) as live:
        yield live
        live.wait_idle()
        assert not leaks(live), leaks(live)
        assert live.engine.is_running, f"the engine thread died: {live.engine.last_error}"


@pytest.fixture(scope="module")
def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _line(custom_id: str, body: dict, url: str = "/v1/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _wait(client: OpenAI, batch_id: str, timeout: float = 120) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.1)


def _read(client: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.decode().splitlines()]


def test_completions_batch_sync(server: LiveServer, client: OpenAI):
    bodies = {f"req-{i}": {"model": server.model, "prompt": p, "max_tokens": 8, "temperature": 0.0}
              for i, p in enumerate(PROMPTS)}
    bad = {"bad-type": {"prompt": "hi", "max_tokens": "ten"},  # the endpoint's own 400
           "bad-model": {"model": "no-such-model", "prompt": "hi", "max_tokens": 2}}  # its 404
    data = _jsonl([_line(k, v) for k, v in {**bodies, **bad}.items()])
    upload = client.files.create(file=("requests.jsonl", data), purpose="batch")
    assert upload.id.startswith("file-") and upload.object == "file" and upload.bytes == len(data)
    assert upload.purpose == "batch" and upload.status == "processed" and upload.filename == "requests.jsonl"
    assert client.files.retrieve(upload.id).id == upload.id
    assert upload.id in [f.id for f in client.files.list()]
    assert client.files.content(upload.id).content == data

    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"job": "sync"})
    assert batch.id.startswith("batch_") and batch.object == "batch" and batch.metadata == {"job": "sync"}
    assert batch.status in ("validating", "in_progress")
    done = _wait(client, batch.id)
    assert done.status == "completed" and done.completed_at and done.in_progress_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 6, 2)
    assert batch.id in [b.id for b in client.batches.list()]

    outputs, errors = _read(client, done.output_file_id), _read(client, done.error_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(bodies)  # each exactly once
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    for out in outputs:
        assert out["id"].startswith("batch_req_") and out["error"] is None
        assert out["response"]["status_code"] == 200
        direct = client.completions.create(**bodies[out["custom_id"]])
        body = out["response"]["body"]
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == direct.choices[0].text  # greedy: the same text
        assert body["usage"]["completion_tokens"] == direct.usage.completion_tokens
    assert done.usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in outputs)
    status = {e["custom_id"]: e["response"]["status_code"] for e in errors}
    assert status == {"bad-type": 400, "bad-model": 404}
    error = {e["custom_id"]: e["response"]["body"]["error"] for e in errors}
    assert error["bad-type"]["param"] == "max_tokens" and error["bad-model"]["code"] == "model_not_found"


def test_chat_batch_async(server: LiveServer):
    questions = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?"]
    bodies = {f"chat-{i}": {"model": server.model, "messages": [{"role": "user", "content": q}], "max_tokens": 12,
                            "temperature": 0.0}
              for i, q in enumerate(questions)}

    async def main() -> tuple[list[dict], dict[str, str]]:
        client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        data = _jsonl([_line(k, v, "/v1/chat/completions") for k, v in bodies.items()])
        upload = await client.files.create(file=("chat.jsonl", data), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        while batch.status not in ("completed", "failed", "cancelled"):
            await asyncio.sleep(0.1)
            batch = await client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.error_file_id is None
        content = await client.files.content(batch.output_file_id)
        outputs = [json.loads(line) for line in content.content.decode().splitlines()]
        direct = await asyncio.gather(*(client.chat.completions.create(**b) for b in bodies.values()))
        return outputs, {k: d.choices[0].message.content for k, d in zip(bodies, direct)}

    outputs, direct = asyncio.run(main())
    assert [o["custom_id"] for o in outputs] == list(bodies)  # in input order, each once
    for out in outputs:
        assert out["response"]["body"]["object"] == "chat.completion"
        assert out["response"]["body"]["choices"][0]["message"]["content"] == direct[out["custom_id"]]


def test_cancel_keeps_what_finished(server: LiveServer, client: OpenAI):
    service: BatchService = server.app.state.batches
    service.max_in_flight = 1  # one line at a time, so the cancel lands mid-batch
    try:
        lines = [_line(f"c-{i}", {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 12, "temperature": 0.0,
                                  "ignore_eos": True}) for i in range(12)]
        upload = client.files.create(file=("cancel.jsonl", _jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
        done = _wait(client, batch.id)
    finally:
        service.max_in_flight = 16
    assert done.status == "cancelled" and done.cancelled_at
    assert 1 <= done.request_counts.completed < 12 and done.request_counts.failed == 0
    outputs = _read(client, done.output_file_id)
    ids = [o["custom_id"] for o in outputs]
    assert len(ids) == len(set(ids)) == done.request_counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing
    assert server.wait_idle()["nanoserve_kv_blocks_used"] == 0  # the aborted line freed its KV


def _refused(call, status: int, *words: str) -> dict:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == status, info.value
    error = info.value.body
    assert set(error) == {"message", "type", "param", "code"}, error  # OpenAI's error shape
    for word in words:
        assert word in error["message"], error
    return error


def test_bad_inputs_are_clear_4xx(server: LiveServer, client: OpenAI):
    good = _line("a", {"prompt": "hi", "max_tokens": 2})

    def upload(data: bytes, purpose: str = "batch"):
        return lambda: client.files.create(file=("in.jsonl", data), purpose=purpose)

    _refused(upload(_jsonl([good]) + b"not json\n"), 400, "Line 2", "JSONL")
    _refused(upload(_jsonl([good]) + b'{"custom_id": "\xff"}\n'), 400, "Line 2", "UTF-8")
    _refused(upload(b"[1, 2]\n"), 400, "Line 1", "object")
    _refused(upload(_jsonl([good, good])), 400, "Line 2", "custom_id")
    _refused(upload(_jsonl([{**good, "method": "GET"}])), 400, "method")
    _refused(upload(_jsonl([{**good, "url": "/v1/embeddings"}])), 400, "url")
    _refused(upload(_jsonl([{**good, "body": "hi"}])), 400, "body")
    _refused(upload(b"\n\n"), 400, "no requests")
    _refused(upload(_jsonl([good]), purpose="fine-tune"), 400, "purpose")
    service: BatchService = server.app.state.batches
    service.max_file_bytes = 1024
    try:
        error = _refused(upload(_jsonl([good] * 100)), 413, "1024 bytes")
        assert error["code"] == "file_too_large"
    finally:
        service.max_file_bytes = 32 * 1024 * 1024
    form = httpx.post(server.url + "/v1/files", content=b"{}", headers={"content-type": "application/json"})
    assert form.status_code == 400 and "multipart" in form.json()["error"]["message"]

    ok = client.files.create(file=("in.jsonl", _jsonl([good])), purpose="batch")

    def create(**kwargs):
        return lambda: client.batches.create(**{"input_file_id": ok.id, "endpoint": "/v1/completions",
                                                "completion_window": "24h", **kwargs})

    assert _refused(create(input_file_id="file-nope"), 404, "file-nope")["param"] == "input_file_id"
    _refused(create(endpoint="/v1/chat/completions"), 400, "Line 1", "/v1/completions")
    _refused(create(endpoint="/v1/embeddings"), 400, "endpoint")
    _refused(create(completion_window="1h"), 400, "24h")
    _refused(lambda: client.batches.retrieve("batch_nope"), 404, "batch_nope")
    _refused(lambda: client.files.content("file-nope"), 404, "file-nope")
    finished = _wait(client, create()().id)
    assert finished.status == "completed"
    _refused(lambda: client.batches.cancel(finished.id), 400, "completed")
    assert client.files.delete(ok.id).deleted
    _refused(lambda: client.files.retrieve(ok.id), 404)


# -- persistence, on a stub server (no model) ----------------------------------------------------
class StubServer:
    """run_batch_request as a slow echo; 'fail' in the prompt is refused like a bad body."""

    model_name = "stub"

    def __init__(self, down: bool = False) -> None:
        self.calls: list[str] = []
        self.down = down  # answer 503, as a draining server does

    async def run_batch_request(self, url: str, body: dict) -> dict:
        self.calls.append(body["prompt"])
        await asyncio.sleep(0.01)
        if self.down:
            raise APIError("The server is shutting down.", 503)
        if "fail" in body["prompt"]:
            raise APIError("refused", param="prompt")
        return {"id": f"cmpl-{body['prompt']}", "object": "text_completion", "choices": [{"text": body["prompt"]}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}


async def _until(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


def test_results_log_drops_a_torn_line(tmp_path: Path):
    path = tmp_path / "x.results"
    path.write_bytes(b'{"custom_id": "a", "n": 1}\n{"custom_id": "b", "n": 2}\n{"custom_id": "c", "n"')
    log = ResultLog.open(path)
    assert list(log.lines) == ["a", "b"]
    log.append("c", b'{"custom_id": "c", "n": 3}')
    log.append("a", b'{"custom_id": "a", "n": 9}')  # already done: not written twice
    log.close()
    assert path.read_bytes().count(b"\n") == 3
    assert ResultLog.open(path).lines["c"] == b'{"custom_id": "c", "n": 3}'


def test_stop_and_restart_run_each_request_exactly_once(tmp_path: Path):
    prompts = [f"p{i}" for i in range(40)] + ["fail-1"]
    data = _jsonl([_line(f"id-{p}", {"prompt": p}) for p in prompts])

    async def first_run() -> tuple[str, dict[str, bytes]]:
        service = BatchService(StubServer(), tmp_path, max_in_flight=4)
        await service.start()
        file_id = service.store.add_file(data, "in.jsonl", "batch")["id"]
        batch = await service.create(CreateBatch(input_file_id=file_id, endpoint="/v1/completions",
                                                 completion_window="24h"))
        job = service.jobs[batch["id"]]
        await _until(lambda: job.record["request_counts"]["completed"] >= 10)
        await service.stop()  # aborts the 4 in flight: they left no result line
        assert job.record["status"] == "in_progress"
        return batch["id"], dict(job.log.lines)

    batch_id, before = asyncio.run(first_run())
    assert 10 <= len(before) < len(prompts)
    with open(BatchStore(tmp_path).results_path(batch_id), "ab") as f:
        f.write(b'{"id": "batch_req_torn", "custom_id": "id-p3')  # as if killed mid-write

    stub = StubServer()

    async def second_run() -> dict:
        service = BatchService(stub, tmp_path, max_in_flight=4)
        await service.start()
        job = service.jobs[batch_id]
        await _until(lambda: job.record["status"] == "completed")
        await service.stop()
        return job.record

    record = asyncio.run(second_run())
    assert record["request_counts"] == {"total": 41, "completed": 40, "failed": 1}
    assert len(stub.calls) == len(prompts) - len(before)  # nothing finished ran again
    store = BatchStore(tmp_path)
    out = store.file_content(record["output_file_id"]).splitlines()
    err = store.file_content(record["error_file_id"]).splitlines()
    ids = [json.loads(line)["custom_id"] for line in out + err]
    assert sorted(ids) == sorted(f"id-{p}" for p in prompts)  # each exactly once, none lost
    for line in out + err:  # what finished before the stop is kept byte for byte
        custom_id = json.loads(line)["custom_id"]
        if custom_id in before:
            assert line == before[custom_id]
    assert json.loads(err[0])["response"]["status_code"] == 400


def test_unavailable_server_pauses_the_batch_instead_of_failing_lines(tmp_path: Path):
    data = _jsonl([_line(f"id-{i}", {"prompt": f"p{i}"}) for i in range(10)])

    async def run(stub: StubServer, batch_id: str | None = None) -> dict:
        service = BatchService(stub, tmp_path, max_in_flight=2)
        await service.start()
        if batch_id is None:
            file_id = service.store.add_file(data, "in.jsonl", "batch")["id"]
            batch_id = (await service.create(CreateBatch(input_file_id=file_id, endpoint="/v1/completions",
                                                         completion_window="24h")))["id"]
        job = service.jobs[batch_id]
        await _until(lambda: job.runner is None)  # paused, or finished
        await service.stop()
        return job.record

    down = StubServer(down=True)
    paused = asyncio.run(run(down))
    assert paused["status"] == "in_progress" and len(down.calls) <= 2  # stopped launching at the 503s
    assert paused["request_counts"]["completed"] == paused["request_counts"]["failed"] == 0
    done = asyncio.run(run(StubServer(), paused["id"]))  # "after a restart"
    assert done["status"] == "completed" and done["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
