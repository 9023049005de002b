"""Work that stops when its client leaves.

uvicorn does not cancel a route when the client closes the connection; it only queues an
``http.disconnect`` message. A route whose work is long (episodes, generation) polls for
it and cancels the work, so a client that left cannot keep a service busy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from mempo.service import ServiceError

T = TypeVar("T")


class ClientGone(ServiceError):
    """The client closed the connection before the answer was ready (nginx's 499)."""

    status_code = 499


async def client_gone(request: Request) -> bool:
    """True once the client has closed the connection (the body was read already, so the
    next ASGI message can only be a disconnect). Starlette's is_disconnected() does not
    see it through the HTTP middleware."""
    try:
        message = await asyncio.wait_for(request.receive(), timeout=0.001)
    except asyncio.TimeoutError:
        return False
    return bool(message.get("type") == "http.disconnect")


async def cancel_on_disconnect(request: Request, work: Awaitable[T], poll_s: float = 0.5) -> T:
    """Await ``work`` as a task, polling every ``poll_s`` for a disconnect; once the client
    has gone the task is cancelled (and awaited) and ``ClientGone`` raised."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await client_gone(request):
                task.cancel()
                await asyncio.wait({task})
                raise ClientGone("the client closed the connection; its work was cancelled")
    finally:
        task.cancel()  # a no-op once done; cancels the work when this route is cancelled
