"""Non-streaming requests whose client goes away: cancel the work, so the engine request is aborted.

Starlette cancels a streaming response when its client disconnects, but not a plain handler awaiting a result,
which would otherwise keep generating (and holding KV pages) until max_tokens. As vLLM's `with_cancellation`,
the work races a listener for `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer; nobody reads it


class ClientDisconnected(Exception):
    pass


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientDisconnected (with `work` cancelled) if the client left first."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, listener):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
    if task.cancelled():  # the listener won: the finally above cancelled the work
        raise ClientDisconnected()
    return task.result()
