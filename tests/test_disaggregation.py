"""Prefill/decode disaggregation end to end: two prefill servers (TP 2) and a decode server (TP 4, checksum mode) behind
`jaxserve router`, each its own process on fake CPU devices, against one colocated server (TP 1) with the same
flags: the same greedy tokens and logprobs (1e-5), streamed and not, with chunked prompts, prefix-cache hits on both
sides and n > 1; a corrupted transfer caught by the checksums; a prefill server killed mid-request."""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import subprocess
import time

import httpx
import numpy as np
import pytest
from test_cli import JAXSERVE, SMALL, ServeProcess, cli_env

from jaxserve.checkpoints.load import load_model
from jaxserve.config import EngineConfig
from jaxserve.engine.handoff import PrefillAsk
from jaxserve.model.cache import kv_geometry
from jaxserve.model.sharding import make_mesh, shardings_for
from jaxserve.request import SamplingParams
from jaxserve.runner.model_runner import powers_of_two_up_to
from jaxserve.runner.speculative import abstract_runner_cache
from jaxserve.runner.transfer import StateMover, TransferFailed, TransferPort
from jaxserve.server.disaggregation import Disaggregation, PrefillClient

TOLERANCE = 1e-5
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 400, 150)]  # three chunks of 64 tokens
SHARED = PROMPT[:100] + [11, 12, 13, 14, 15, 16, 17]  # six of its pages, then its own


def _ready_url(process: ServeProcess) -> str:
    return process.wait_for_line("jaxserve ready on http://127.0.0.1:", 900).split()[3]


@pytest.fixture(scope="module")
def servers():
    started = {
        "colocated": ServeProcess(*SMALL, "--port", "0"),
        "prefill_a": ServeProcess(
            *SMALL, "--port", "0", "--tensor-parallel-size", "2", "--disaggregation-mode", "prefill"
        ),
        "prefill_b": ServeProcess(
            *SMALL, "--port", "0", "--tensor-parallel-size", "2", "--disaggregation-mode", "prefill"
        ),
        "decode": ServeProcess(
            *SMALL,
            "--port",
            "0",
            "--tensor-parallel-size",
            "4",
            "--disaggregation-mode",
            "decode",
            "--disaggregation-checksum",
        ),
    }
    router = None
    try:
        urls = {name: _ready_url(process) for name, process in started.items()}
        router = subprocess.Popen(
            [
                JAXSERVE,
                "router",
                "--prefill",
                urls["prefill_a"],
                urls["prefill_b"],
                "--decode",
                urls["decode"],
                "--port",
                "0",
                "--health-check-interval",
                "0.2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=cli_env(),
        )
        line = router.stdout.readline()
        while line and not line.startswith("jaxserve router ready on "):
            line = router.stdout.readline()
        assert line, "the router did not start"
        urls["router"] = line.split()[-1]
        _wait_healthy(urls["router"])
        yield urls, started
    finally:
        if router is not None:
            router.kill()
        for process in started.values():
            process.kill()


def _wait_healthy(url: str, seconds: float = 60) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        answer = httpx.get(url + "/health", timeout=5)
        if answer.status_code == 200:
            return answer.json()
        time.sleep(0.2)
    raise AssertionError(f"the router never became healthy: {answer.json()}")


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    found = re.search(rf"^jaxserve:{name}(?:_total)?{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


def complete(url: str, stream: bool = False, **fields) -> list[tuple[list[str], list[float], list[dict]]]:
    """Each choice's tokens, their logprobs and top logprobs."""
    body = {"max_tokens": 12, "temperature": 0, "logprobs": 3, **fields, "stream": stream}
    if not stream:
        answer = httpx.post(url + "/v1/completions", json=body, timeout=180)
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        return [
            (c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]) for c in choices
        ]
    per_choice: dict[int, tuple[list, list, list]] = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                tokens, logprobs, top = per_choice.setdefault(choice["index"], ([], [], []))
                tokens += choice["logprobs"]["tokens"]
                logprobs += choice["logprobs"]["token_logprobs"]
                top += choice["logprobs"]["top_logprobs"]
    return [per_choice[i] for i in sorted(per_choice)]


def assert_same(pd, colocated) -> None:
    assert len(pd) == len(colocated)
    for (tokens, logprobs, top), (want_tokens, want_logprobs, want_top) in zip(pd, colocated):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=TOLERANCE, rtol=0)
        for mine, theirs in zip(top, want_top):
            assert mine.keys() == theirs.keys()
            np.testing.assert_allclose(list(mine.values()), [theirs[k] for k in mine], atol=TOLERANCE, rtol=0)


def test_disaggregated_tokens_and_logprobs_are_the_colocated_ones(servers):
    urls, _ = servers
    router, colocated = urls["router"], urls["colocated"]
    hits = {side: metric(urls[side], "prefix_cache_hits") for side in ("prefill_a", "prefill_b", "decode")}
    cases = [
        dict(prompt=PROMPT),  # chunked: 150 tokens in chunks of 64
        dict(prompt=PROMPT, stream=True),
        dict(prompt=SHARED),  # its first pages are cached on the decode server and on a prefill server
        dict(prompt=SHARED, stream=True, max_tokens=20),
        dict(prompt=PROMPT[:40], n=3, temperature=0.8, seed=5),  # n > 1, sampled: each choice with its seed
        dict(prompt=PROMPT[:40], n=2, stream=True),
    ]
    for case in cases:
        assert_same(complete(router, **case), complete(colocated, **case))
    # The pages the decode server already held did not travel again, and the prefill servers hit their caches too.
    assert metric(urls["decode"], "prefix_cache_hits") > hits["decode"]
    assert (
        sum(metric(urls[s], "prefix_cache_hits") for s in ("prefill_a", "prefill_b"))
        > hits["prefill_a"] + hits["prefill_b"]
    )
    assert metric(urls["decode"], "kv_cache_usage_perc") == 0  # every page came back


def test_a_corrupted_transfer_fails_the_request_in_checksum_mode(servers):
    """This test process is the decode side: it asks a prefill server for a prompt's state and pulls it, with one byte
    flipped on arrival."""
    urls, _ = servers
    config = EngineConfig(dtype="float32", max_num_seqs=4, chunked_prefill_size=64, page_size=16, max_model_len=256)
    mesh = make_mesh(1, 1)
    model = load_model(None, mesh, dtype="float32").config
    geometry = kv_geometry(config, model)
    abstract = abstract_runner_cache(model, geometry)
    mover = StateMover(
        abstract,
        shardings_for(abstract, mesh),
        mesh,
        geometry.num_pages,
        powers_of_two_up_to(geometry.max_pages_per_seq),
    )
    port = TransferPort(mover.device, "127.0.0.1")
    side = Disaggregation("decode", port, mover, transfer_timeout=30, checksum=True)
    client = PrefillClient(urls["prefill_a"], side)
    ask = PrefillAsk("corrupt-me", PROMPT[:70], SamplingParams(max_tokens=4, temperature=0), skip_pages=0)

    arrival = client.fetch(ask)  # whole: it passes its checks
    assert arrival.parcel is not None and arrival.parcel.pages == 5
    pull = port.pull

    def corrupting_pull(*args, **kwargs):
        parts = pull(*args, **kwargs)
        parts[-1] = parts[-1].at[(0,) * parts[-1].ndim].add(1)  # one element of one array changes
        return parts

    port.pull = corrupting_pull  # type: ignore[method-assign]
    with pytest.raises(TransferFailed, match=r"the transferred state is corrupt: 1 of \d+ arrays differ"):
        client.fetch(ask)


def test_each_role_refuses_what_is_not_its_own_naming_why(servers):
    urls, _ = servers
    body = {"prompt": PROMPT[:20], "max_tokens": 2}
    answer = httpx.post(urls["prefill_a"] + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 400 and "runs --disaggregation-mode prefill" in answer.json()["error"]["message"]
    answer = httpx.post(urls["decode"] + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 400 and "X-Prefill-Url header (missing)" in answer.json()["error"]["message"]
    ask = {"request_id": "x", "prompt_token_ids": PROMPT[:20], "sampling": {}, "skip_pages": 0, "checksum": False}
    answer = httpx.post(urls["decode"] + "/v1/disaggregation/prefill", json={**ask, "layout": []}, timeout=30)
    assert answer.status_code == 400 and "does not run --disaggregation-mode prefill" in answer.text
    answer = httpx.post(urls["prefill_a"] + "/v1/disaggregation/prefill", json={**ask, "layout": []}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "layout"
    assert "the peer's state has 0 arrays" in answer.json()["error"]["message"]


def test_a_killed_prefill_server_fails_its_requests_and_the_router_routes_around_it(servers):
    urls, started = servers
    router, victim = urls["router"], urls["prefill_b"]
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 400, 200)] for i in range(4)]

    def stream(prompt: list[int]) -> tuple[str | None, float]:
        """The error the client got (None: it completed), and when it ended."""
        body = {"prompt": prompt, "max_tokens": 20, "ignore_eos": True, "stream": True}
        error = None
        with httpx.stream("POST", router + "/v1/completions", json=body, timeout=60) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: {") and "error" in (chunk := json.loads(line[6:])):
                    error = chunk["error"]["message"]
        return error, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, prompt) for prompt in prompts]
        deadline = time.monotonic() + 60
        while metric(victim, "num_requests_running") == 0:  # it is prefilling: kill it now
            assert time.monotonic() < deadline, "the prefill server never got a request"
            time.sleep(0.01)
        started["prefill_b"].process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        results = [future.result(timeout=60) for future in futures]
    failed = [(error, ended) for error, ended in results if error is not None]
    assert failed and len(failed) < len(prompts), results  # the survivor served its share
    for error, ended in failed:
        assert ended - killed < 15 and "prefill failed" in error, (error, ended - killed)
    deadline = time.monotonic() + 15
    while metric(urls["decode"], "num_requests_running") or metric(urls["decode"], "kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the decode server kept pages of the failed requests"
        time.sleep(0.1)
    health = _wait_healthy(router)
    assert [s["healthy"] for s in health["servers"] if s["url"] == victim] == [False]
    for _ in range(2):  # both go to the prefill server left
        assert_same(complete(router, prompt=PROMPT[:30]), complete(urls["colocated"], prompt=PROMPT[:30]))
