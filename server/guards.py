"""ASGI guards in front of every route: a request that cannot be served is refused before routing.

- LoadingGate: while the engine loads and compiles, or drains for shutdown, every route but /metrics and /version
  answers 503 with the reason (so /v1/models does not claim a model that cannot answer yet); /metrics stays up for
  the scrapers watching the start-up or the drain.
- BodyLimit: a body over `max_bytes` is refused with 413 before it is read: at once when Content-Length says so,
  or as soon as the bytes received pass the limit (chunked uploads, cut off there). A body refused by its declared
  length is then read and dropped, up to DRAIN_MAX_BYTES or DRAIN_MAX_SECONDS, before the connection closes (a
  lingering close, as nginx's): a client that sends its whole body before reading the answer (Python's urllib,
  requests) reads the 413 instead of a connection reset, which closing on unread data would send it.
"""

from __future__ import annotations

import asyncio
import contextlib

from jaxserve.server.errors import APIError
from jaxserve.server.state import ServerState

ALWAYS_OPEN = ("/metrics", "/version")
DRAIN_MAX_BYTES = 64 * 2**20
DRAIN_MAX_SECONDS = 5.0


class LoadingGate:
    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in ALWAYS_OPEN:
            try:
                self.state.check_available()
            except APIError as unavailable:
                await unavailable.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestTooLarge(APIError):
    def __init__(self, size: str, max_bytes: int):
        # Connection: close, so the server drops the connection instead of reading the rest of the body.
        super().__init__(
            413,
            f"The request body is too large: {size} bytes, more than the server's limit of "
            f"{max_bytes} bytes (--max-request-bytes)",
            headers={"Connection": "close"},
        )


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse_then_drain(RequestTooLarge(declared.decode(), self.max_bytes), scope, receive, send)
            return
        received = 0

        async def bounded_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read, before any response: the error handler answers 413.
                    raise RequestTooLarge(f"over {self.max_bytes}", self.max_bytes)
            return message

        await self.app(scope, bounded_receive, send)

    @staticmethod
    async def _refuse_then_drain(error: RequestTooLarge, scope, receive, send) -> None:
        """The whole 413 now, but its end only once the body is drained: the server closes the connection (Connection:
        close) when a response ends."""

        async def send_held_open(message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "more_body": True}
            await send(message)

        await error.response()(scope, receive, send_held_open)
        received = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DRAIN_MAX_SECONDS):
                while received < DRAIN_MAX_BYTES:
                    message = await receive()
                    received += len(message.get("body", b""))
                    if message["type"] != "http.request" or not message.get("more_body", False):
                        break  # all of it, or the client left
        await send({"type": "http.response.body", "body": b"", "more_body": False})
