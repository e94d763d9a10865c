"""The FastAPI app: OpenAI routes under /v1 and SageMaker's /invocations (behind the API key), /health and /ping,
/version, /metrics, OpenAI-shaped errors, behind the guards (503 while loading or draining, 413 for oversized
bodies) and the access log.

The app uses only the engine's public API and does not own its lifecycle: whoever made the engine starts it
(every route but /metrics answers 503 "Loading model" until then) and shuts it down.
"""

from __future__ import annotations

import asyncio
import contextlib
from importlib.metadata import version as package_version

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.engine import Engine
from jaxserve.server.access_log import AccessLog
from jaxserve.server.config import ServerConfig
from jaxserve.server.disaggregation import Disaggregation
from jaxserve.server.disaggregation import router as disaggregation_router
from jaxserve.server.errors import install_error_handlers
from jaxserve.server.guards import BodyLimit, LoadingGate
from jaxserve.server.metrics import CONTENT_TYPE
from jaxserve.server.routes import router, sagemaker_router
from jaxserve.server.state import ServerState
from jaxserve.server.stats_log import log_stats_forever
from jaxserve.server.tokenize import router as tokenize_router

JAXSERVE_VERSION = package_version("jaxserve")

# Routes read the app's state from the request and close over nothing: FastAPI caches facts about each endpoint
# function process-wide, so an endpoint that closed over one app's state kept its engine (and the compiled steps)
# alive after the app was gone.
operations_router = APIRouter()


# /ping is SageMaker's /health (GET and POST, as vLLM serves it); both stay open, as /version and /metrics do.
@operations_router.get("/health")
@operations_router.api_route("/ping", methods=["GET", "POST"])
async def health() -> Response:
    return JSONResponse({"status": "ok"})  # the gate answers 503 while loading or draining


@operations_router.get("/version")
async def version() -> dict:
    return {"version": JAXSERVE_VERSION}


@operations_router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.server.metrics.exposition(), media_type=CONTENT_TYPE)


def create_app(
    engine: Engine,
    tokenizer,
    served_model_name: str,
    config: ServerConfig = ServerConfig(),
    model_path: str | None = None,
    disaggregation: Disaggregation | None = None,
) -> FastAPI:
    state = ServerState(
        engine,
        tokenizer,
        served_model_name,
        model_path=model_path,
        api_key=config.api_key,
        disaggregation=disaggregation,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        interval = config.log_stats_interval
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
    app.include_router(sagemaker_router)
    app.include_router(tokenize_router)
    app.include_router(disaggregation_router)
    app.include_router(operations_router)
    # add_middleware puts each one outside the ones before it: the access log sees every answer, the guards' too.
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(LoadingGate, state=state)
    if config.access_log:
        app.add_middleware(AccessLog)

    return app
