"""Responses that notice the client leaving: an SSE stream that aborts its generation when the
client disconnects, even while waiting for the next token, and a wait that cancels a
non-streaming generation nobody will read.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from nanoserve.server.errors import APIError

T = TypeVar("T")


KEEPALIVE_SECONDS = 15.0  # an SSE comment after this long without an event


class EventStream(StreamingResponse):
    """An SSE response that notices a client disconnect even while waiting for the next token,
    and always closes its body iterator, so the generation behind it is aborted promptly."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None,
                 keepalive: float | None = KEEPALIVE_SECONDS) -> None:
        # no-cache and no proxy buffering: each token must reach the client when it is made
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close
        self.keepalive = keepalive

    async def stream_response(self, send: Any) -> None:
        """Starlette's, plus a keep-alive: while no event has gone out for `keepalive` seconds (a
        request still queued, a long prefill), an SSE comment does, so proxies and clients with
        idle timeouts keep the connection (clients ignore comments: the SSE format's rule)."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        lock, last = anyio.Lock(), [time.monotonic()]

        async def body(chunk: bytes) -> None:
            async with lock:  # one message at a time from the two tasks
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                last[0] = time.monotonic()

        async def heartbeat(interval: float) -> None:
            while True:
                await anyio.sleep(max(0.0, last[0] + interval - time.monotonic()))
                if time.monotonic() - last[0] >= interval:
                    await body(b": keep-alive\n\n")

        async with anyio.create_task_group() as group:
            if self.keepalive:
                group.start_soon(heartbeat, self.keepalive)
            async for chunk in self.body_iterator:
                await body(chunk.encode(self.charset) if isinstance(chunk, str) else bytes(chunk))
            group.cancel_scope.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def run_then_cancel(func: Any) -> None:
                    try:
                        await func()
                    except OSError:  # the socket died mid-send: same as a disconnect
                        pass
                    finally:
                        group.cancel_scope.cancel()

                group.start_soon(run_then_cancel, partial(self.stream_response, send))
                await run_then_cancel(partial(self.listen_for_disconnect, receive))
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            if self.on_close is not None:  # the body may never have started: aclose ran nothing
                self.on_close()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request | None, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away first (a non-streaming response
    would otherwise keep generating for nobody). No request: a batch line, nobody to lose."""
    if request is None:
        return await work
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        # 499 is nginx's "client closed request"; nobody reads it, but logs and metrics do.
        raise APIError("The client disconnected before the response was ready.", 499, type="client_closed_request")
    finally:
        task.cancel()
        watcher.cancel()
