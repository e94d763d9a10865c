"""Server-sent events: `data: <one-line JSON>\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end.

Once the headers are out the status is fixed at 200, so an error in the middle of a stream is sent as one
`data: {"error": {...}}` event, still followed by [DONE].
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from jaxserve.server.errors import APIError, error_body

log = logging.getLogger("jaxserve.server")

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield event(chunk)
    except APIError as error:
        yield event(error.body())
    except Exception as error:  # noqa: BLE001 - the client must still get an error event and [DONE]
        log.exception("error while streaming")
        yield event(error_body(500, f"internal server error: {type(error).__name__}: {error}"))
    yield DONE


def sse_response(chunks: AsyncIterator[dict]) -> StreamingResponse:
    # A client that disconnects makes Starlette cancel this stream; the cancellation reaches the Generation,
    # which aborts its engine request.
    return StreamingResponse(
        _events(chunks),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
