"""`jaxserve router`: the front of disaggregated serving (docs/architecture.md, "Disaggregated prefill and decode").

It speaks the same OpenAI API as a server and holds no model: each completion goes to a decode server, naming the
prefill server that is to prefill it (the `X-Prefill-Url` header, jaxserve.server.disaggregation); the decode
server's answer, streamed or not, comes back as it is. Servers are taken in turn among the healthy ones: every server
is asked `/health` every `health_interval` seconds, and one that does not answer 200 is routed around until it does
again; a decode server that cannot be reached is marked down at once and the request goes to the next one (nothing
was sent yet, so nothing is done twice). No healthy server of a role: 503 naming the role. A decode server that dies
or goes silent for `upstream_timeout` seconds in the middle of an answer ends it with an error (a stream: an error
event and [DONE], as a server's own failures are sent), and is marked down.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from jaxserve.server.disaggregation import PREFILL_URL_HEADER
from jaxserve.server.errors import APIError, error_body, install_error_handlers
from jaxserve.server.sse import DONE, event

log = logging.getLogger("jaxserve.router")

HEALTH_TIMEOUT_S = 2.0
# Headers of the client's request the decode server gets as they are (the API key and the body's type); the router
# adds its own.
PASSED_HEADERS = ("authorization", "content-type", "x-request-id")

router = APIRouter()


@dataclass
class Upstream:
    url: str
    role: str  # "prefill" or "decode"
    healthy: bool = False
    why: str = "not checked yet"


@dataclass
class Pool:
    """The servers of one role, taken in turn among the healthy ones."""

    role: str
    servers: list[Upstream]
    _turn: itertools.count = field(default_factory=itertools.count)

    @staticmethod
    def of(role: str, urls: list[str]) -> Pool:
        if not urls:
            raise ValueError(f"the router needs at least one {role} server (--{role} URL)")
        return Pool(role, [Upstream(url.rstrip("/"), role) for url in urls])

    def in_turn(self) -> list[Upstream]:
        """The healthy servers, starting with the one whose turn it is."""
        healthy = [server for server in self.servers if server.healthy]
        if not healthy:
            return []
        start = next(self._turn) % len(healthy)
        return healthy[start:] + healthy[:start]

    def unavailable(self) -> APIError:
        why = "; ".join(f"{server.url}: {server.why}" for server in self.servers)
        return APIError(503, f"no {self.role} server is available ({why})")


class Routing:
    """The router's state: both pools, the HTTP client, the health checks."""

    def __init__(
        self, prefill: list[str], decode: list[str], health_interval: float = 0.5, upstream_timeout: float = 600.0
    ):
        self.prefill, self.decode = Pool.of("prefill", prefill), Pool.of("decode", decode)
        self.health_interval = health_interval
        # A decode server's answer may first wait for its prompt's prefill (queued behind others): minutes at most.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(upstream_timeout, connect=HEALTH_TIMEOUT_S))

    @property
    def servers(self) -> list[Upstream]:
        return self.prefill.servers + self.decode.servers

    async def check(self, server: Upstream) -> None:
        try:
            answer = await self.client.get(server.url + "/health", timeout=HEALTH_TIMEOUT_S)
            healthy, why = answer.status_code == 200, f"/health answered {answer.status_code}"
        except httpx.HTTPError as error:
            healthy, why = False, f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        if healthy != server.healthy:
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "%s server %s is %s",
                server.role,
                server.url,
                "up" if healthy else f"down ({why})",
            )
        server.healthy, server.why = healthy, "healthy" if healthy else why

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(server) for server in self.servers))

    async def watch(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.health_interval)

    def mark_down(self, server: Upstream, why: str) -> None:
        log.warning("%s server %s is down (%s)", server.role, server.url, why)
        server.healthy, server.why = False, why


def create_router_app(routing: Routing) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await routing.check_all()
        task = asyncio.create_task(routing.watch())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await routing.client.aclose()

    app = FastAPI(title="jaxserve router", lifespan=lifespan)
    app.state.routing = routing
    install_error_handlers(app)
    app.include_router(router)
    return app


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when a request can be served (a healthy server of each role), else 503; the servers' states either way."""
    routing: Routing = request.app.state.routing
    servers = [{"url": s.url, "role": s.role, "healthy": s.healthy, "status": s.why} for s in routing.servers]
    ready = any(s.healthy for s in routing.prefill.servers) and any(s.healthy for s in routing.decode.servers)
    return JSONResponse({"status": "ok" if ready else "unavailable", "servers": servers}, 200 if ready else 503)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return await _forward(request, "GET", "/v1/models", body=None, prefill=None)


@router.post("/v1/completions")
@router.post("/v1/chat/completions")
async def completions(request: Request) -> Response:
    routing: Routing = request.app.state.routing
    prefill = routing.prefill.in_turn()
    if not prefill:
        raise routing.prefill.unavailable()
    return await _forward(request, "POST", request.url.path, await request.body(), prefill[0])


async def _forward(request: Request, method: str, path: str, body: bytes | None, prefill: Upstream | None) -> Response:
    """The answer of the first decode server in turn that can be reached, streamed back as it comes."""
    routing: Routing = request.app.state.routing
    headers = {name: value for name, value in request.headers.items() if name.lower() in PASSED_HEADERS}
    if prefill is not None:
        headers[PREFILL_URL_HEADER] = prefill.url
    for decode in routing.decode.in_turn():
        upstream = routing.client.build_request(method, decode.url + path, content=body, headers=headers)
        try:
            answer = await routing.client.send(upstream, stream=True)
        except httpx.TransportError as error:
            routing.mark_down(decode, f"{type(error).__name__}: {error}")
            continue
        kept = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "retry-after")}
        return StreamingResponse(
            _relayed(routing, decode, answer),
            status_code=answer.status_code,
            headers=kept,
            background=BackgroundTask(answer.aclose),
        )
    raise routing.decode.unavailable()


async def _relayed(routing: Routing, decode: Upstream, answer: httpx.Response) -> AsyncIterator[bytes]:
    """The decode server's answer as it comes; if it breaks off, an error the client can read instead of a cut: in a
    stream an error event and [DONE] (after whole events only: the server writes each in one piece), else the
    error's JSON where the body was to be."""
    try:
        async for data in answer.aiter_raw():
            yield data
    except httpx.HTTPError as error:
        why = f"decode server {decode.url} broke off its answer: {type(error).__name__}: {error}"
        routing.mark_down(decode, why)
        body = error_body(502, why)
        streaming = answer.headers.get("content-type", "").startswith("text/event-stream")
        yield (event(body) + DONE).encode() if streaming else json.dumps(body).encode()
