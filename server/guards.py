"""ASGI guards in front of every route: a request that cannot be served is refused before routing.

- LoadingGate: while the engine loads and compiles, or drains for shutdown, every route but /metrics and /version
  answers 503 with the reason (so /v1/models does not claim a model that cannot answer yet); /metrics stays up for
  the scrapers watching the start-up or the drain.
- BodyLimit: a body over `max_bytes` is refused with 413 without being read: at once when Content-Length says so,
  or as soon as the bytes received pass the limit (chunked uploads).
"""

from __future__ import annotations

from jaxserve.server.errors import APIError
from jaxserve.server.state import ServerState

ALWAYS_OPEN = ("/metrics", "/version")


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
            await RequestTooLarge(declared.decode(), self.max_bytes).response()(scope, receive, send)
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
