"""`jaxserve router` against stand-in servers (small ASGI apps on real sockets): which server a request goes to, what
it is told, and what the client gets when a server is down, unreachable or breaks off its answer."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxserve.server.disaggregation import PREFILL_URL_HEADER
from jaxserve.server.router import Routing, create_router_app
from jaxserve.server.serving import BackgroundServer, bind


def stand_in(name: str, break_off: bool = False) -> FastAPI:
    """A server that answers /health, and completions with its name and the prefill server it was told of (streamed:
    two events, or one and then a dropped connection when `break_off`)."""
    app = FastAPI()
    app.state.healthy = True

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({}, 200 if app.state.healthy else 503)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        said = {"server": name, "prefill": request.headers.get(PREFILL_URL_HEADER), "prompt": body["prompt"]}
        if not body.get("stream"):
            return JSONResponse(said)

        async def events():
            yield f"data: {json.dumps(said)}\n\n"
            if break_off:
                raise RuntimeError("the server died")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class Serving:
    def __init__(self, app: FastAPI):
        self.app = app
        self.server = BackgroundServer(app, bind("127.0.0.1", 0))
        self.server.start()
        self.url = f"http://127.0.0.1:{self.server.address[1]}"


@pytest.fixture
def cluster():
    servers = {
        "p1": Serving(stand_in("p1")),
        "p2": Serving(stand_in("p2")),
        "d1": Serving(stand_in("d1")),
        "d2": Serving(stand_in("d2", break_off=True)),
    }
    routing = Routing([servers["p1"].url, servers["p2"].url], [servers["d1"].url, servers["d2"].url], 0.05)
    router = Serving(create_router_app(routing))
    try:
        yield servers, router.url
    finally:
        for serving in (router, *servers.values()):
            serving.server.stop()


def wait_until(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_requests_take_the_servers_in_turn_and_name_a_prefill_server(cluster):
    servers, router = cluster
    answers = [httpx.post(router + "/v1/completions", json={"prompt": i}).json() for i in range(4)]
    assert [a["server"] for a in answers] == ["d1", "d2", "d1", "d2"]
    assert [a["prefill"] for a in answers] == [servers[p].url for p in ("p1", "p2", "p1", "p2")]
    assert [a["prompt"] for a in answers] == [0, 1, 2, 3]


def test_an_unhealthy_server_is_routed_around_and_a_role_with_none_is_a_503_naming_it(cluster):
    servers, router = cluster
    servers["p1"].app.state.healthy = False
    wait_until(lambda: not httpx.get(router + "/health").json()["servers"][0]["healthy"])
    assert {httpx.post(router + "/v1/completions", json={"prompt": 0}).json()["prefill"] for _ in range(3)} == {
        servers["p2"].url
    }
    servers["p2"].app.state.healthy = False
    wait_until(lambda: httpx.get(router + "/health").status_code == 503)
    answer = httpx.post(router + "/v1/completions", json={"prompt": 0})
    assert answer.status_code == 503
    assert answer.json()["error"]["message"].startswith("no prefill server is available (")
    servers["p1"].app.state.healthy = True  # back: served again
    wait_until(lambda: httpx.get(router + "/health").status_code == 200)
    assert httpx.post(router + "/v1/completions", json={"prompt": 0}).json()["prefill"] == servers["p1"].url


def test_an_unreachable_decode_server_is_skipped_at_once_and_one_that_breaks_off_ends_the_stream_with_an_error(
    cluster, caplog
):
    servers, router = cluster
    with httpx.stream("POST", router + "/v1/completions", json={"prompt": 1, "stream": True}) as answer:
        lines = [line for line in answer.iter_lines() if line]
    assert json.loads(lines[0][6:])["server"] == "d1"
    with httpx.stream("POST", router + "/v1/completions", json={"prompt": 2, "stream": True}) as answer:
        lines = [line for line in answer.iter_lines() if line]
    assert json.loads(lines[0][6:])["server"] == "d2"
    error = json.loads(lines[1][6:])["error"]
    assert error["message"].startswith(f"decode server {servers['d2'].url} broke off its answer")
    assert lines[-1] == "data: [DONE]"
    # Marked down at once (its /health still answers, so the next check brings it back: not asserted on /health).
    assert f"decode server {servers['d2'].url} is down (decode server" in caplog.text
    wait_until(lambda: all(s["healthy"] for s in httpx.get(router + "/health").json()["servers"]))  # d2 back
    servers["d1"].server.stop()  # gone: its port refuses
    answers = [httpx.post(router + "/v1/completions", json={"prompt": i}) for i in range(2)]
    assert all(a.status_code == 200 and a.json()["server"] == "d2" for a in answers)
