"""Prefill/decode disaggregation over HTTP (docs/architecture.md, "Disaggregated prefill and decode").

A decode server's request names its prefill server in the `X-Prefill-Url` header (`jaxserve router` sets it). Once
the decode server's engine has admitted the request (its pages and slot reserved, the pages it already holds for the
prompt found), `PrefillClient.fetch` asks the prefill server's `POST /v1/disaggregation/prefill` to prefill the
prompt from its token ids, sample the first token, and offer the state from the first page the decode server lacks;
the answer names the offer (the prefill server's transfer address and an id), and the decode server pulls it with
jax.experimental.transfer (jaxserve.runner.transfer), checking it against the sender's checksums in checksum mode.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.config import EngineConfig
from jaxserve.engine import Engine
from jaxserve.engine.handoff import Arrival, PrefillAsk
from jaxserve.request import FinishReason, InvalidRequest, SamplingParams, TokenLogprob
from jaxserve.request.grammar import Constraint, ConstraintKind
from jaxserve.runner.transfer import Parcel, StateMover, TransferFailed, TransferPort, verify
from jaxserve.server.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, cancel_on_disconnect
from jaxserve.server.errors import APIError, bad_request

log = logging.getLogger("jaxserve.server")

PREFILL_URL_HEADER = "X-Prefill-Url"
PREFILL_PATH = "/v1/disaggregation/prefill"
ABORT_PATH = "/v1/disaggregation/abort"
ABORT_TIMEOUT_S = 5.0
# How long a decode server waits for its prefill server's answer: the prompt may queue there behind others. A prefill
# server that dies fails the request at once (the connection drops); one that hangs, after this.
PREFILL_ANSWER_TIMEOUT_S = 600.0

ASK_FIELDS = ("request_id", "prompt_token_ids", "sampling", "skip_pages", "layout")  # what a decode server sends

router = APIRouter()


# ---- what travels over HTTP --------------------------------------------------------------------------------------
def sampling_to_json(sampling: SamplingParams) -> dict:
    fields = dataclasses.asdict(sampling)
    if sampling.constraint is not None:
        constraint = sampling.constraint
        fields["constraint"] = {"kind": constraint.kind.value, "spec": constraint.spec, "field": constraint.field}
    return fields


def sampling_from_json(fields: dict) -> SamplingParams:
    fields = dict(fields)
    if (constraint := fields.get("constraint")) is not None:
        fields["constraint"] = Constraint(ConstraintKind(constraint["kind"]), constraint["spec"], constraint["field"])
    for name in ("stop_token_ids", "eos_token_ids", "logit_bias"):
        fields[name] = tuple(tuple(x) if isinstance(x, list) else x for x in fields.get(name, ()))
    return SamplingParams(**fields)


def logprob_to_json(logprob: TokenLogprob) -> list:
    return [logprob.token_id, logprob.logprob, [list(pair) for pair in logprob.top]]


def logprob_from_json(entry: list) -> TokenLogprob:
    token, value, top = entry
    return TokenLogprob(int(token), float(value), tuple((int(t), float(v)) for t, v in top))


# ---- the two sides -----------------------------------------------------------------------------------------------
@dataclass
class TransferCounts:
    """A server's transfers so far (/metrics): states moved (offered by a prefill server, arrived at a decode server),
    their bytes (bucket padding included: what travelled), failed ones, and on a decode server the seconds spent
    waiting for prefill servers' answers and for the states to arrive and pass their checks."""

    transfers: int = 0
    bytes: int = 0
    failures: int = 0
    prefill_wait_s: float = 0.0
    transfer_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)


@dataclass
class Disaggregation:
    """A disaggregated server's side of it: its mode, its transfer port and how its state is cut."""

    mode: str  # EngineConfig.disaggregation_mode: "prefill" or "decode"
    port: TransferPort
    mover: StateMover
    transfer_timeout: float
    checksum: bool
    counts: TransferCounts = field(default_factory=TransferCounts)
    # A decode server's connections to its prefill servers, kept open between requests (the client is thread-safe).
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=PREFILL_ANSWER_TIMEOUT_S))

    @staticmethod
    def for_runner(config: EngineConfig, runner: Any) -> Disaggregation | None:
        """The disaggregation the engine's configuration asks for (None: colocated); the runner's transfers are
        compiled here, so no request waits for them."""
        if config.disaggregation_mode == "null":
            return None
        prefill = config.disaggregation_mode == "prefill"
        runner.warm_transfers(export=prefill, install=not prefill)
        port = TransferPort(runner.mover.device, config.disaggregation_transfer_host)
        log.info("%s server: state transfers on %s", config.disaggregation_mode, port.address)
        return Disaggregation(
            config.disaggregation_mode,
            port,
            runner.mover,
            config.disaggregation_transfer_timeout,
            config.disaggregation_checksum,
        )

    def source(self, request: Request) -> PrefillClient | None:
        """The prefill server a decode server's request names (400 when it names none); None on a prefill server,
        whose engine refuses completions (Engine.submit: it takes requests from decode servers only)."""
        if self.mode != "decode":
            return None
        url = request.headers.get(PREFILL_URL_HEADER)
        if not url:
            raise bad_request(
                None,
                f"this server runs --disaggregation-mode decode: its requests come through `jaxserve router`, which "
                f"names their prefill server in the {PREFILL_URL_HEADER} header (missing)",
            )
        return PrefillClient(url.rstrip("/"), self)


class PrefillClient:
    """A decode server's StateSource: one prefill server, asked over HTTP, its state pulled over the transfer port."""

    def __init__(self, url: str, side: Disaggregation):
        self.url, self._side = url, side
        # Each ask's id on the prefill server: the decode server's request id and a tag of this client's, as two
        # decode servers may give their requests the same id.
        self._tag = secrets.token_hex(4)

    def _prefill_id(self, ask: PrefillAsk) -> str:
        return f"{ask.request_id}@{self._tag}"

    def cancel(self, ask: PrefillAsk) -> None:
        """Ask the prefill server to abort the prompt (its answer then fails, and is dropped here); a server that
        cannot be reached is making nothing for it anyway."""
        try:
            self._side.http.post(
                self.url + ABORT_PATH, json={"request_id": self._prefill_id(ask)}, timeout=ABORT_TIMEOUT_S
            )
        except httpx.HTTPError as error:
            log.info("request %s: could not tell %s to stop its prefill: %s", ask.request_id, self.url, error)

    def fetch(self, ask: PrefillAsk) -> Arrival:
        try:
            return self._fetch(ask)
        except Exception:
            self._side.counts.add(failures=1)
            raise

    def _fetch(self, ask: PrefillAsk) -> Arrival:
        side = self._side
        body = {
            "request_id": self._prefill_id(ask),
            "prompt_token_ids": ask.prompt_ids,
            "sampling": sampling_to_json(ask.sampling),
            "skip_pages": ask.skip_pages,
            "layout": side.mover.layout.to_json(),
            "checksum": side.checksum,
        }
        asked = time.perf_counter()
        try:
            answer = side.http.post(self.url + PREFILL_PATH, json=body)
        except httpx.HTTPError as error:
            raise TransferFailed(f"prefill server {self.url}: {type(error).__name__}: {error}") from None
        if answer.status_code != 200:
            raise TransferFailed(f"prefill server {self.url} answered {answer.status_code}: {_message(answer)}")
        offer = answer.json()
        answered = time.perf_counter()
        side.counts.add(prefill_wait_s=answered - asked)
        logprob = None if offer["logprob"] is None else logprob_from_json(offer["logprob"])
        prompt = offer["prompt_logprobs"]
        prompt_logprobs = None if prompt is None else tuple(map(logprob_from_json, prompt))
        if offer["uuid"] is None:  # a prefill-only request: nothing to move
            return Arrival(None, None, prompt_logprobs, None)
        specs = side.mover.layout.specs(offer["bucket"], side.port.device)
        parts = side.port.pull(offer["address"], int(offer["uuid"]), specs, side.transfer_timeout)
        parcel = Parcel(parts, offer["pages"], offer["bucket"])
        if side.checksum:
            verify(parcel, np.asarray(offer["checksums"], np.uint32), side.mover.checksums(parts), side.mover.layout)
        side.counts.add(transfers=1, bytes=parcel.nbytes, transfer_s=time.perf_counter() - answered)
        return Arrival(offer["token"], logprob, prompt_logprobs, parcel)


def _message(answer: httpx.Response) -> str:
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return answer.text[:200]


def _prefill_side(request: Request) -> Disaggregation:
    side: Disaggregation | None = request.app.state.server.disaggregation
    if side is None or side.mode != "prefill":
        raise bad_request(None, f"{request.url.path}: this server does not run --disaggregation-mode prefill")
    return side


@router.post(ABORT_PATH)
async def abort(request: Request) -> Response:
    """A decode server's request ended while this server prefilled it: abort it (unknown or finished ids: nothing)."""
    _prefill_side(request)
    body = json.loads(await request.body())
    if not isinstance(body.get("request_id"), str):
        raise bad_request("request_id", f"{ABORT_PATH}: the body needs the request_id the prefill was asked with")
    request.app.state.server.engine.abort(f"prefill-{body['request_id']}")
    return JSONResponse({})


@router.post(PREFILL_PATH)
async def prefill(request: Request) -> Response:
    """A prefill server's half: prefill the prompt, sample its first token, offer its state to the asking decode
    server (module docstring)."""
    state = request.app.state.server
    side = _prefill_side(request)
    body = json.loads(await request.body())
    missing = [name for name in ASK_FIELDS if name not in body]
    if missing:
        raise bad_request(missing[0], f"{PREFILL_PATH}: the body lacks {', '.join(missing)}")
    if (why := side.mover.layout.mismatch(body["layout"])) is not None:
        raise bad_request("layout", f"layout: the decode server's KV state cannot take this server's: {why}")
    engine: Engine = state.engine
    try:
        sampling = sampling_from_json(body["sampling"])
        handle = engine.submit(
            body["prompt_token_ids"],
            sampling,
            request_id=f"prefill-{body['request_id']}",
            hand_off_from=int(body["skip_pages"]),
        )
    except (InvalidRequest, TypeError, ValueError) as error:
        raise bad_request(getattr(error, "param", None), f"{PREFILL_PATH}: {error}") from None

    async def last_event():
        last = None
        async for event in handle.events():
            last = event
        return last

    try:
        last = await cancel_on_disconnect(request, last_event())
    except ClientDisconnected:  # the decode server went away: nobody will pull
        engine.abort(handle.request_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    assert last is not None
    if last.finish_reason is FinishReason.ERROR or (last.parcel is None and sampling.max_tokens):
        raise APIError(500, f"prefill failed: {last.error or last.finish_reason}")
    answer: dict[str, Any] = {
        "token": last.token_ids[0] if last.token_ids else None,
        "logprob": logprob_to_json(last.logprobs[0]) if last.logprobs else None,
        "prompt_logprobs": None if last.prompt_logprobs is None else [logprob_to_json(p) for p in last.prompt_logprobs],
        "cached_tokens": last.cached_tokens,
        "uuid": None,
    }
    if (parcel := last.parcel) is not None:
        side.counts.add(transfers=1, bytes=parcel.nbytes)
        answer.update(
            address=side.port.address,
            uuid=str(side.port.offer(parcel.parts, side.transfer_timeout)),
            pages=parcel.pages,
            bucket=parcel.bucket,
            bytes=parcel.nbytes,
            checksums=side.mover.checksums(parcel.parts).tolist() if body.get("checksum") else None,
        )
    return JSONResponse(answer)
