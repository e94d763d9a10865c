"""The FastAPI app: OpenAI routes under /v1 (behind the API key), /health, /metrics, OpenAI-shaped errors.

The app uses only the engine's public API and does not own its lifecycle: whoever made the engine starts it
(`/health` answers 503 "Loading model" until then) and shuts it down.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.engine import Engine
from jaxserve.server.errors import APIError, install_error_handlers
from jaxserve.server.metrics import CONTENT_TYPE
from jaxserve.server.routes import router
from jaxserve.server.state import ServerState
from jaxserve.server.stats_log import log_stats_forever
from jaxserve.server.tokenize import router as tokenize_router


def create_app(engine: Engine, tokenizer, served_model_name: str, api_key: str | None = None,
               model_path: str | None = None) -> FastAPI:
    state = ServerState(engine, tokenizer, served_model_name, model_path=model_path, api_key=api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        interval = engine.config.log_stats_interval
        task = asyncio.create_task(log_stats_forever(engine, interval)) if interval > 0 else None
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="jaxserve", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(tokenize_router)

    @app.get("/health")
    async def health() -> Response:
        reason = state.unavailable_reason()
        return JSONResponse({"status": "ok"}) if reason is None else APIError(503, reason).response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    return app
