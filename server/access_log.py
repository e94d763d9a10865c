"""The access log: one line per request when its response has been sent (or the client left), with the client,
method, path, status, the request's prompt and completion tokens when it generated, and the seconds it took.

Routes that generate put their Generations (one per choice) on `request.state.generations` and their prompts'
tokens (each prompt once, as the usage counts them) on `request.state.prompt_tokens`; the line reads its counts at
the end, so a stream's line has its final token count."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("jaxserve.access")


class AccessLog:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = "-"  # no response started: the client left first, or the server failed
        request_state = scope.setdefault("state", {})

        async def send_noting_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            query = f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else ""
            generations = request_state.get("generations")
            tokens = (
                ""
                if not generations
                else f" prompt_tokens={request_state['prompt_tokens']} "
                f"completion_tokens={sum(g.num_generated for g in generations)}"
            )
            log.info(
                '%s "%s %s%s" %s%s %.3f s',
                who,
                scope["method"],
                scope["path"],
                query,
                status,
                tokens,
                time.monotonic() - started,
            )
