"""`--api-key`: the /v1 routes want `Authorization: Bearer <key>`; /health, /ping, /version and /metrics stay open,
as in vLLM. Unlike vLLM's (which guards /v1 only), /invocations and the tokenizer routes want it too: they
generate or tokenize on the server's devices and CPU."""

from __future__ import annotations

import hmac

from fastapi import Request

from jaxserve.server.errors import APIError


async def require_api_key(request: Request) -> None:
    expected = request.app.state.server.api_key
    if expected is None or request.method == "OPTIONS":  # CORS preflights carry no credentials
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise APIError(
            401,
            "Invalid or missing API key: send `Authorization: Bearer <key>`",
            headers={"WWW-Authenticate": "Bearer"},
        )
