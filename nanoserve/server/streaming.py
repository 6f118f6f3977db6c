"""Responses that notice the client leaving: an SSE stream that aborts its generation when the
client disconnects, even while waiting for the next token, and a wait that cancels a
non-streaming generation nobody will read.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from nanoserve.server.errors import APIError

T = TypeVar("T")


class EventStream(StreamingResponse):
    """An SSE response that notices a client disconnect even while waiting for the next token,
    and always closes its body iterator, so the generation behind it is aborted promptly."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> None:
        # no-cache and no proxy buffering: each token must reach the client when it is made
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

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
