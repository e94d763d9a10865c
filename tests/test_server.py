"""The HTTP server against a real uvicorn on 127.0.0.1 (the embedded default checkpoint, a small engine config):
the openai client and raw httpx, SSE framing, bad inputs, auth, 404/429/503, token-id-only mode, client
disconnects, a mid-stream engine failure, metrics, and a bounded load test.

One runner (tests/served_runner.py) is compiled once for the test session and shared by every engine here and in
the modules that serve the same model (test_logprobs, test_structured_outputs, test_lm_eval). Engines on one runner
must not run steps at the same time, so each test keeps all but one of them idle (the runner's cache belongs to
whoever steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import random
import shutil
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from served_runner import CONFIG, MODEL

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.checkpoints.load import load_model
from jaxserve.config import load_config
from jaxserve.engine import Engine
from jaxserve.model.sharding import make_mesh
from jaxserve.request import SamplingParams
from jaxserve.server import create_app
from jaxserve.server.config import ServerConfig
from jaxserve.server.serving import BackgroundServer, bind
from jaxserve.text.tokenizer import TokenIdOnly

VOCAB = load_config(default_checkpoint_path()).vocab_size  # the embedded default's: the first id past it
API_KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PREFIX = "jaxserve:"
SETTLE_S = 1.0  # how long the engine may take to return an aborted request's pages (a deadline, not a timing)


@dataclasses.dataclass
class Served:
    url: str
    engine: Engine


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.01)


@contextmanager
def serving(runner, loaded, tokenizer=None, start=True, server_config=ServerConfig(log_stats_interval=0), **overrides):
    tokenizer = tokenizer or loaded.tokenizer
    grammars = tokenizer.grammar_compiler(loaded.config.vocab_size)
    engine = Engine(dataclasses.replace(CONFIG, **overrides), loaded.config, runner, tokenizer.eos_ids, grammars)
    if start:
        engine.start()
    app = create_app(engine, tokenizer, MODEL, server_config, model_path=str(default_checkpoint_path()))
    # As `jaxserve serve` does once compiled: the heap so far (here also what earlier tests left in JAX's caches)
    # is frozen, so no full collection walks it in the middle of a stream (one took 0.5 s after the plan tests).
    gc.collect()
    gc.freeze()
    try:
        with serve_app(app, engine) as served:
            yield served
    finally:
        gc.unfreeze()
        engine.shutdown()


@contextmanager
def serve_app(app, engine: Engine):
    """`app` served on a free port of 127.0.0.1 from a thread, the CLI's own way."""
    http = BackgroundServer(app, bind("127.0.0.1", 0))
    try:
        http.start()
        yield Served(f"http://127.0.0.1:{http.address[1]}", engine)
    finally:
        http.stop()


@pytest.fixture(scope="module")
def server(runner, loaded):
    with serving(runner, loaded, server_config=ServerConfig(api_key=API_KEY, log_stats_interval=0)) as server:
        yield server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        yield http


def before_each_decode(runner, monkeypatch, action) -> None:
    """Patch the runner so that `action()` runs before every step that carries decode rows is dispatched."""
    real = runner.dispatch

    def dispatch(batch):
        if batch.decode:
            action()
        return real(batch)

    monkeypatch.setattr(runner, "dispatch", dispatch)


@pytest.fixture
def slow_decode(runner, monkeypatch):
    """Every decode step takes at least 10 ms more, so a long request is still running when a client leaves."""
    before_each_decode(runner, monkeypatch, lambda: time.sleep(0.01))


def sse_payloads(lines) -> list:
    """The `data:` payloads of an SSE stream: dicts, and the final "[DONE]"."""
    payloads = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            payloads.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return payloads


def settled(engine: Engine) -> bool:
    stats = engine.stats()
    return stats.running == 0 and stats.waiting == 0 and stats.free_pages == stats.total_pages


# ---- the openai client ---------------------------------------------------------------------------------------------


def test_openai_completions_streaming_and_not(client):
    args = dict(
        model=MODEL, prompt="Where does the river run?", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**args)
    assert whole.object == "text_completion" and whole.model == MODEL
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8 and whole.usage.total_tokens == whole.usage.prompt_tokens + 8

    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    content, usage = chunks[:-1], chunks[-1]
    assert len(content) == 8  # one chunk per token
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text  # greedy: the same output
    assert [c.choices[0].finish_reason for c in content] == [None] * 7 + ["length"]
    assert usage.choices == [] and usage.usage.completion_tokens == 8
    assert len({c.id for c in chunks}) == 1


def test_openai_chat_streaming_and_not(client):
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**args)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6

    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = chunks[1:]
    assert len(content) == 6 and content[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content for c in content) == whole.choices[0].message.content


def test_seeded_sampling_repeats_and_max_completion_tokens_is_honoured(client):
    def sample(seed):
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me"}],
            temperature=1.0,
            seed=seed,
            max_completion_tokens=10,
            extra_body={"ignore_eos": True},
        )

    first, again = sample(7), sample(7)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.usage.completion_tokens == 10


def test_openai_client_errors(server, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256 tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1000)


# ---- raw HTTP ------------------------------------------------------------------------------------------------------


def test_token_id_prompt_and_return_token_ids(http, loaded):
    prompt = [5, 17, 99, 250, 3]
    body = http.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
    ).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 7
    assert choice["text"] == loaded.tokenizer.decode(choice["token_ids"])
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    with http.stream(
        "POST",
        "/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": 7,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        },
    ) as response:
        chunks = sse_payloads(response.iter_lines())[:-1]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert "prompt_token_ids" not in chunks[1]["choices"][0]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]


def test_sse_framing(http):
    with http.stream(
        "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "ignore_eos": True, "stream": True}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response.iter_lines())
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert len(chunks) == 5 and all(len(c["choices"]) == 1 for c in chunks)  # no usage chunk unasked
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]


def greedy_text(http, max_tokens: int = 24) -> tuple[str, list[int]]:
    choice = http.post(
        "/v1/completions",
        json={
            "prompt": [7, 8, 9],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    ).json()["choices"][0]
    return choice["text"], choice["token_ids"]


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include_stop_str_in_output"])
def test_stop_strings_cut_the_text_and_never_leak_into_the_stream(http, include):
    text, _ = greedy_text(http)
    stop = text[6:8]
    expected = text[: text.find(stop) + (len(stop) if include else 0)]  # vLLM's include_stop_str_in_output
    request = {"prompt": [7, 8, 9], "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": ["zzzz", stop]}
    request["include_stop_str_in_output"] = include
    choice = http.post("/v1/completions", json=request).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (expected, "stop", stop)

    with http.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
        chunks = sse_payloads(response.iter_lines())[:-1]
    streamed = [c["choices"][0]["text"] for c in chunks]
    assert "".join(streamed) == expected and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_truncate_prompt_tokens_keeps_the_last_tokens_in_both_apis(http):
    long = list(range(2, 302))  # longer than the context on its own
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    cut = http.post("/v1/completions", json={**body, "prompt": long, "truncate_prompt_tokens": 10}).json()
    alone = http.post("/v1/completions", json={**body, "prompt": long[-10:]}).json()
    assert cut["choices"][0]["prompt_token_ids"] == long[-10:] and cut["usage"]["prompt_tokens"] == 10
    assert cut["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    whole = http.post("/v1/completions", json={**body, "prompt": long[:100], "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == 100  # -1: up to the context, which it fits
    chat = http.post(
        "/v1/chat/completions",
        json={
            **body,
            "messages": [{"role": "user", "content": "Hello there, how are you"}],
            "truncate_prompt_tokens": 3,
        },
    ).json()
    assert chat["usage"]["prompt_tokens"] == 3 and len(chat["prompt_token_ids"]) == 3


def test_a_seed_is_a_signed_64_bit_integer_as_in_vllm(client):
    """Either end of the range samples (as its value modulo 2**32 does); one past either end is a 400 naming seed."""
    common = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 6, "temperature": 1.0}
    for seed in (-(2**63), 2**63 - 1):
        answer = client.completions.create(seed=seed, **common, extra_body={"return_token_ids": True})
        same = client.completions.create(seed=seed % 2**32, **common, extra_body={"return_token_ids": True})
        assert answer.choices[0].model_dump()["token_ids"] == same.choices[0].model_dump()["token_ids"], seed
    for seed in (2**63, -(2**63) - 1, 2**64 - 1):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(seed=seed, **common)
        error = refused.value.body
        assert error["param"] == "seed"
        assert error["message"] == f"seed: must be a signed 64-bit integer, in [-2**63, 2**63), got {seed}"


def test_truncation_side_right_keeps_the_first_tokens_and_anything_else_is_a_400(client):
    """vLLM's truncation_side: left (the default) keeps the prompt's last truncate_prompt_tokens, right its first."""
    long = list(range(2, 302))
    common = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True, "truncate_prompt_tokens": 10}

    def completion(prompt, **fields):
        return client.completions.create(prompt=prompt, **common, extra_body={**extra, **fields}).model_dump()

    for side, kept in (("left", long[-10:]), ("right", long[:10]), (None, long[-10:])):
        fields = {} if side is None else {"truncation_side": side}
        cut = completion(long, **fields)["choices"][0]
        assert cut["prompt_token_ids"] == kept, side
        assert cut["token_ids"] == completion(kept)["choices"][0]["token_ids"], side
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello there, how are you"}],
        **common,
        extra_body={**extra, "truncate_prompt_tokens": 3, "truncation_side": "right"},
    ).model_dump()
    whole = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello there, how are you"}],
        **common,
        extra_body={"return_token_ids": True},
    ).model_dump()
    assert chat["prompt_token_ids"] == whole["prompt_token_ids"][:3]
    with pytest.raises(openai.BadRequestError) as refused:
        completion(long, truncation_side="middle")
    error = refused.value.body
    assert (
        error["param"] == "truncation_side"
        and error["message"] == "truncation_side: must be 'left' or 'right', got 'middle'"
    )


@pytest.mark.parametrize("value", [0, -2, 257, "5"])
def test_a_bad_truncate_prompt_tokens_is_a_400_naming_it(http, value):
    response = http.post("/v1/completions", json={"prompt": "Hi", "truncate_prompt_tokens": value})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "truncate_prompt_tokens", response.text
    if value == 257:
        assert error["message"].startswith("truncate_prompt_tokens value (257) is greater than max_model_len (256)")


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(http):
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (
        ("/v1/completions", {"prompt": [5, 6, 7], "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        request = {**body, "max_tokens": 3, "ignore_eos": True, "stream": True, "stream_options": options}
        with http.stream("POST", path, json=request) as response:
            chunks = sse_payloads(response.iter_lines())[:-1]
        final = chunks[-1]["usage"]
        counts: dict[int, list[int]] = {}
        for chunk in chunks[:-1]:
            (choice,) = chunk["choices"]
            counts.setdefault(choice["index"], []).append(chunk["usage"]["completion_tokens"])
            assert chunk["usage"]["prompt_tokens"] == final["prompt_tokens"]  # one prompt, counted once
        opening = [0] if path.endswith("chat/completions") else []
        assert all(c == opening + [1, 2, 3] for c in counts.values()), counts
        assert final["completion_tokens"] == 3 * len(counts)


def test_every_eos_id_of_the_generation_config_ends_generation_in_the_engine_and_over_http(
    http, runner, loaded, tmp_path
):
    prompts = [[7, 8, 9], [20, 21, 22, 23]]
    ids = [
        http.post(
            "/v1/completions",
            json={"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        ).json()["choices"][0]["token_ids"]
        for p in prompts
    ]
    # Two EOS ids, each ending one prompt's greedy continuation first: the checkpoint's config.json says 1.
    eos_a = next(t for t in ids[0][2:] if t != 1)
    stop_a = ids[0].index(eos_a)
    eos_b = next(
        t
        for i, t in enumerate(ids[1][2:], 2)
        if t not in ids[0][: stop_a + 1] + [1] and not {eos_a, 1} & set(ids[1][:i])
    )
    stop_b = ids[1].index(eos_b)
    assert 1 not in ids[0][:stop_a] and eos_b not in ids[0][: stop_a + 1] and eos_a not in ids[1][: stop_b + 1]
    folder = tmp_path / "two-eos"
    shutil.copytree(default_checkpoint_path(), folder)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [eos_a, eos_b]}))
    tokenizer = load_model(folder, make_mesh(1, 1), dtype=CONFIG.dtype).tokenizer
    assert set(tokenizer.eos_ids) == {eos_a, eos_b, 1}

    engine = Engine(CONFIG, loaded.config, runner, tokenizer.eos_ids).start()
    try:
        handles = [engine.submit(p, SamplingParams(max_tokens=24, temperature=0.0)) for p in prompts]
        through_engine = [h.wait(timeout=60) for h in handles]
    finally:
        engine.shutdown()
    assert through_engine == [(ids[0][: stop_a + 1], "stop", None), (ids[1][: stop_b + 1], "stop", None)]

    with (
        serving(runner, loaded, tokenizer=tokenizer) as two_eos,
        httpx.Client(base_url=two_eos.url, timeout=60) as client,
    ):
        choices = [
            client.post(
                "/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
            ).json()["choices"][0]
            for p in prompts
        ]
    assert [(c["token_ids"], c["finish_reason"], c["stop_reason"]) for c in choices] == [
        (ids[0][: stop_a + 1], "stop", None),
        (ids[1][: stop_b + 1], "stop", None),
    ]


def test_stop_token_ids(http):
    _, ids = greedy_text(http)
    stop_id = ids[3]
    choice = http.post(
        "/v1/completions",
        json={
            "prompt": [7, 8, 9],
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stop_token_ids": [stop_id],
            "return_token_ids": True,
        },
    ).json()["choices"][0]
    assert choice["token_ids"] == ids[: ids.index(stop_id) + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)


def test_logit_bias_moves_the_sampled_token_in_both_apis(http, loaded):
    _, ids = greedy_text(http)
    favoured = (ids[0] + 1) % loaded.config.vocab_size
    body = {"prompt": [7, 8, 9], "max_tokens": 1, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    first = http.post("/v1/completions", json={**body, "logit_bias": {str(ids[0]): -100}}).json()["choices"][0]
    assert first["token_ids"][0] != ids[0]
    first = http.post("/v1/completions", json={**body, "logit_bias": {str(favoured): 100}}).json()["choices"][0]
    assert first["token_ids"] == [favoured]
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "temperature": 0,
        "return_token_ids": True,
    }
    plain = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["token_ids"]
    biased = http.post("/v1/chat/completions", json={**chat, "logit_bias": {str(favoured): 100}}).json()
    assert biased["choices"][0]["token_ids"] == [favoured] != plain


@pytest.mark.parametrize(
    "bias, what",
    [
        ({"5": 101}, "logit_bias: biases must be in [-100, 100], got 5: 101"),
        ({"x": 1}, "logit_bias: keys must be token ids, got 'x'"),
        ({"5": "high"}, "logit_bias: biases must be numbers, got 5: 'high'"),
        ({"99999": 1}, "logit_bias: token id 99999 is outside the vocabulary [0, "),
        # every entry at fault is named, not only the first
        ({"5": 1, "x": 1, "7": 2, "y": 3}, "logit_bias: keys must be token ids, got 'x', 'y'"),
        ({"5": 1, "6": "a", "7": [1]}, "logit_bias: biases must be numbers, got 6: 'a', 7: [1]"),
        ({"5": -101, "6": 1, "7": 250.5}, "logit_bias: biases must be in [-100, 100], got 5: -101, 7: 250.5"),
        ({"5": 1, "99999": 1, "100000": 2}, "logit_bias: token ids 99999, 100000 are outside the vocabulary [0, "),
        (
            {str(t): 1 for t in range(100000, 100011)},
            "token ids 100000, 100001, 100002, 100003, 100004, 100005, 100006, 100007, and 3 more are outside",
        ),
    ],
)
def test_a_bad_logit_bias_is_a_400_naming_it(client, bias, what):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logit_bias=bias)
    error = refused.value.body
    assert error["param"] == "logit_bias" and what in error["message"], error


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": [7, 8, 9]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
def test_min_tokens_holds_back_stop_tokens_in_both_apis(http, path, body):
    body = {**body, "temperature": 0, "max_tokens": 6, "return_token_ids": True}
    first = http.post(path, json=body).json()["choices"][0]["token_ids"][0]
    stopped = http.post(path, json={**body, "stop_token_ids": [first]}).json()["choices"][0]
    assert stopped["token_ids"] == [first] and stopped["finish_reason"] == "stop"
    held = http.post(path, json={**body, "stop_token_ids": [first], "min_tokens": 3}).json()["choices"][0]
    # Not sampled before 3 tokens (so the greedy stream takes another way), able to stop from the 4th on.
    assert first not in held["token_ids"][:3] and len(held["token_ids"]) >= 4
    assert held["finish_reason"] == "length" or held["token_ids"][-1] == first


def test_min_tokens_holds_back_stop_strings(http):
    text, ids = greedy_text(http, max_tokens=6)
    stop = text[:2]
    body = {"prompt": [7, 8, 9], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == ""
    held = http.post("/v1/completions", json={**body, "min_tokens": 6}).json()["choices"][0]
    assert held["text"] == text and held["finish_reason"] == "length"


@pytest.mark.parametrize("min_tokens", [-1, 7])
def test_min_tokens_out_of_range_is_a_400(http, min_tokens):
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 6, "min_tokens": min_tokens})
    assert response.status_code == 400 and response.json()["error"]["param"] == "min_tokens", response.text


def test_no_op_label_and_unknown_fields_are_accepted_and_the_unknown_ones_logged(http, caplog):
    body = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": 2,
        "best_of": 1,
        "n": 1,
        "logprobs": None,
        "use_beam_search": False,
        "skip_special_tokens": True,
        "parallel_tool_calls": True,
        "modalities": ["text"],
        "service_tier": "auto",
        "user": "me",
        "metadata": {"team": "evals"},
        "cache_salt": "abc",
    }
    with caplog.at_level("WARNING", logger="jaxserve.server.protocol"):
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
        assert not caplog.records
        response = http.post("/v1/completions", json={**body, "some_future_field": {"x": 1}})
        assert response.status_code == 200
    (record,) = caplog.records
    assert "some_future_field" in record.getMessage() and "ignored" in record.getMessage()


def test_parallel_tool_calls_false_is_a_chat_option_and_a_400_on_completions(http):
    """A completion calls no tools; chat reads it (tests/test_chat_tools_http.py)."""
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "parallel_tool_calls": False})
    assert response.status_code == 400 and response.json()["error"]["param"] == "parallel_tool_calls", response.text
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "parallel_tool_calls": False}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


@pytest.mark.parametrize(
    "field, value",
    [
        ("use_beam_search", True),
        ("length_penalty", 0.5),
        ("bad_words", ["Hi"]),
        ("skip_special_tokens", False),
        ("logits_processors", ["my.module:Processor"]),
        ("functions", [{"name": "f"}]),
        ("store", True),
        ("modalities", ["text", "audio"]),
        ("suffix", "!"),
    ],
)
def test_api_fields_jaxserve_does_not_implement_are_a_400_naming_them(http, field, value):
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        response = http.post(path, json={**body, "max_tokens": 1, field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (path, response.text)


PENALTY_BODY = {
    "prompt": [7, 8, 9],
    "max_tokens": 24,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
}


def test_frequency_and_presence_penalties_pick_the_best_penalized_token(http):
    _, plain = greedy_text(http)
    body = {**PENALTY_BODY, "logprobs": 20, "return_tokens_as_token_ids": True}
    choice = http.post("/v1/completions", json={**body, "frequency_penalty": 1.5, "presence_penalty": 0.5}).json()
    choice = choice["choices"][0]
    ids, tops = choice["token_ids"], choice["logprobs"]["top_logprobs"]
    assert ids != plain
    checked = 0
    for t, (token, top) in enumerate(zip(ids, tops)):
        counts = Counter(ids[:t])  # vLLM's: frequency once per time out, presence once for a token out at all
        scores = {int(name.split(":")[1]): lp for name, lp in top.items()}
        scores = {i: lp - 1.5 * counts[i] - 0.5 * (counts[i] > 0) for i, lp in scores.items()}
        best = max(scores, key=scores.__getitem__)
        # Penalties only lower a score: a token outside the top 20 cannot beat one above the 20th's raw logprob.
        if scores[best] >= min(top.values()):
            assert token == best, t
            checked += 1
    assert checked >= 20
    # A penalty of 0 is no penalty.
    zero = http.post("/v1/completions", json={**PENALTY_BODY, "frequency_penalty": 0, "presence_penalty": 0}).json()
    assert zero["choices"][0]["token_ids"] == plain


def test_a_high_repetition_penalty_repeats_neither_the_prompt_nor_the_output(http):
    _, plain = greedy_text(http)
    assert len(set(plain)) < len(plain)  # the random model loops without it
    for path, extra in (
        ("/v1/completions", {}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt": None}),
    ):
        body = {**PENALTY_BODY, **extra, "repetition_penalty": 100.0}
        body = {k: v for k, v in body.items() if v is not None}
        response = http.post(path, json=body).json()
        ids = response["choices"][0]["token_ids"]
        prompt = response.get("prompt_token_ids") or response["choices"][0].get("prompt_token_ids")
        assert len(set(ids)) == len(ids) and not set(ids) & set(prompt), path


def test_min_p_one_is_greedy_and_allowed_token_ids_are_all_that_is_sampled(http, loaded):
    _, plain = greedy_text(http)
    body = {**PENALTY_BODY, "temperature": 1.0, "seed": 5}
    assert http.post("/v1/completions", json={**body, "min_p": 1.0}).json()["choices"][0]["token_ids"] == plain
    assert http.post("/v1/completions", json={**body, "min_p": 0.0}).json()["choices"][0]["token_ids"] != plain
    allowed = [11, 12, 200, loaded.config.vocab_size - 1]
    for path, extra in (
        ("/v1/completions", {"prompt": [7, 8, 9]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        body = {**{k: v for k, v in PENALTY_BODY.items() if k != "prompt"}, **extra, "temperature": 1.0, "seed": 5}
        ids = http.post(path, json={**body, "allowed_token_ids": allowed}).json()["choices"][0]["token_ids"]
        assert set(ids) <= set(allowed) and len(set(ids)) > 1, path


@pytest.mark.parametrize(
    "field, value, what",
    [
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3, "[-2, 2]"),
        ("repetition_penalty", 0, "greater than zero"),
        ("min_p", 1.5, "[0, 1]"),
        ("presence_penalty", "much", "a number"),
        ("allowed_token_ids", [], "non-empty list"),
        ("allowed_token_ids", [1, VOCAB], "outside the vocabulary"),
        ("allowed_token_ids", "1", "list of token ids"),
        ("best_of", 0, "[n, 128]"),
    ],
)
def test_bad_sampling_fields_are_a_400_naming_them(http, field, value, what):
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
    assert what in response.json()["error"]["message"]


def test_best_of_returns_the_n_candidates_best_per_token_and_bills_them_all(http):
    body = {**PENALTY_BODY, "max_tokens": 8, "temperature": 1.0, "seed": 11}
    candidates = http.post("/v1/completions", json={**body, "n": 4, "logprobs": 0}).json()["choices"]
    means = [statistics.mean(c["logprobs"]["token_logprobs"]) for c in candidates]
    ranked = [candidates[i]["token_ids"] for i in sorted(range(4), key=lambda i: -means[i])]
    assert len({tuple(r) for r in ranked}) == 4  # four different candidates to choose from
    best = http.post("/v1/completions", json={**body, "best_of": 4}).json()
    (choice,) = best["choices"]
    assert choice["token_ids"] == ranked[0] and choice["index"] == 0 and choice["logprobs"] is None
    assert best["usage"]["completion_tokens"] == 4 * 8
    two = http.post("/v1/completions", json={**body, "n": 2, "best_of": 4}).json()["choices"]
    assert [c["token_ids"] for c in two] == ranked[:2] and [c["index"] for c in two] == [0, 1]
    streamed = http.post("/v1/completions", json={**body, "best_of": 4, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "best_of"
    fewer = http.post("/v1/completions", json={**body, "n": 3, "best_of": 2})
    assert fewer.status_code == 400 and fewer.json()["error"]["param"] == "best_of"


def test_chat_echo_puts_the_final_assistant_message_before_the_reply(http):
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello, "}]
    body = {
        "messages": messages,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 6,
        "temperature": 0,
    }
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed["content"] == "Hello, " + plain
    with http.stream("POST", "/v1/chat/completions", json={**body, "echo": True, "stream": True}) as response:
        chunks = [c for c in sse_payloads(response.iter_lines()) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[1]["content"] == "Hello, "
    assert "".join(d.get("content") or "" for d in deltas) == echoed["content"]
    # The last message is the user's: nothing to echo.
    user_last = {"messages": messages[:1], "max_tokens": 6, "temperature": 0}
    alone = http.post("/v1/chat/completions", json=user_last).json()["choices"][0]["message"]["content"]
    echoed = http.post("/v1/chat/completions", json={**user_last, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == alone


def test_a_repeated_prompt_hits_the_prefix_cache_in_usage_and_metrics(server, http, runner, loaded):
    """A 60-token prompt sent twice: the second finds its first 3 pages (48 tokens, page 16) and the snapshot its
    first chunk took there, says so in usage.prompt_tokens_details.cached_tokens and in vLLM's prefix cache
    counters, and streams the same greedy tokens; with --no-enable-prefix-caching nothing is cached."""
    ids = list(range(100, 160))
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def counters(url):
        samples = metric_samples(httpx.get(url + "/metrics").text)
        return [samples[(PREFIX + f"prefix_cache_{n}_total", ())] for n in ("queries", "hits")]

    before = counters(server.url)
    first = http.post("/v1/completions", json=body).json()
    again = http.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [c for c in sse_payloads(again.iter_lines()) if c != "[DONE]"]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]] == first["choices"][0][
        "token_ids"
    ]
    queries, hits = (after - b for after, b in zip(counters(server.url), before))
    assert (queries, hits) == (120, 48)
    info = metric_samples(httpx.get(server.url + "/metrics").text)
    assert any(
        name == PREFIX + "cache_config_info" and ("enable_prefix_caching", "True") in labels for name, labels in info
    )
    with serving(runner, loaded, enable_prefix_caching=False) as plain:
        with httpx.Client(base_url=plain.url, timeout=60) as client:
            for _ in range(2):
                response = client.post("/v1/completions", json=body).json()
                assert response["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
                assert response["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert counters(plain.url) == [0, 0]


def test_the_access_log_counts_each_prompt_of_a_batch_once(http, caplog):
    body = {"prompt": [[5, 6, 7], [8, 9, 10, 11, 12]], "n": 2, "max_tokens": 3, "ignore_eos": True}

    def lines() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "jaxserve.access" and "/v1/completions" in r.getMessage()
        ]

    with caplog.at_level("INFO", logger="jaxserve.access"):
        assert http.post("/v1/completions", json=body).status_code == 200
        # the server writes the line after the response's last byte went out: the client can read it first
        wait_for(lines, SETTLE_S, "the access log's line")
    (line,) = lines()
    assert "prompt_tokens=8 completion_tokens=12 " in line, line


def test_models_health_and_metrics(server, http):
    (card,) = http.get("/v1/models").json()["data"]
    assert card["id"] == MODEL and card["max_model_len"] == CONFIG.max_model_len
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    with httpx.Client(base_url=server.url) as anonymous:  # no API key: both stay open
        assert anonymous.get("/health").json() == {"status": "ok"}
        metrics = anonymous.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in (
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_count",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefill_steps_total",
        "decode_steps_total",
        "forced_decode_steps_total",
        "interleave_decode_steps_total",  # each step policy's (config.STEP_POLICIES)
        "stall_decode_steps_total",
    ):
        assert f"jaxserve:{name}" in text, name
    finished = [
        line for line in text.splitlines() if line.startswith('jaxserve:request_success_total{finished_reason="length"')
    ]
    assert finished and float(finished[0].split()[-1]) >= 1


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, its labels but model_name) -> value, from a /metrics exposition."""
    return {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_vllm_request_step_and_cache_metrics(server, http):
    """The queue time, token counts per request and tokens per step that one request adds, and the constant ones."""
    prompt = [5, 6, 7, 8, 9]
    before = metric_samples(http.get("/metrics").text)
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200
    wait_for(lambda: settled(server.engine), SETTLE_S, "the request to finish")
    after = metric_samples(http.get("/metrics").text)

    def added(name: str, **labels) -> float:
        key = (PREFIX + name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert added("request_prompt_tokens_count") == 1 and added("request_prompt_tokens_sum") == len(prompt)
    assert added("request_generation_tokens_count") == 1 and added("request_generation_tokens_sum") == 3
    assert (
        added("request_generation_tokens_bucket", le="2.0") == 0
        and added("request_generation_tokens_bucket", le="5.0") == 1
    )
    assert added("request_queue_time_seconds_count") == 1 and 0 <= added("request_queue_time_seconds_sum") < 5
    # A prefill step of the 5 prompt tokens (its first token), then a decode step of one row for each other token.
    assert added("iteration_tokens_total_count") >= 3 and added("iteration_tokens_total_sum") >= len(prompt) + 2
    assert added("iteration_tokens_total_bucket", le="1.0") >= 2
    assert after[(PREFIX + "num_preemptions_total", ())] == 0
    geometry = server.engine.geometry
    cache = {
        "block_size": str(geometry.page_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(geometry.num_pages),
    }
    assert after[(PREFIX + "cache_config_info", tuple(sorted(cache.items())))] == 1


def test_vllm_request_phase_and_parameter_histograms(server, client, http):
    """What one prompt with n = 2 adds to vLLM's per-request histograms: its n, each choice's max_tokens, the most
    tokens a choice generated, and each choice's prefill, decode and inference times (inference = prefill + decode,
    from the engine's record of admission, first and last token) and time per output token."""
    before = metric_samples(http.get("/metrics").text)
    answer = client.completions.create(
        model=MODEL, prompt=[5, 6, 7, 8, 9], max_tokens=6, n=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [choice.finish_reason for choice in answer.choices] == ["length", "length"]
    wait_for(lambda: settled(server.engine), SETTLE_S, "the requests to finish")
    after = metric_samples(http.get("/metrics").text)

    def added(name: str, **labels) -> float:
        key = (PREFIX + name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert (added("request_params_n_count"), added("request_params_n_sum")) == (1, 2)
    assert added("request_params_n_bucket", le="1.0") == 0 and added("request_params_n_bucket", le="2.0") == 1
    assert (added("request_params_max_tokens_count"), added("request_params_max_tokens_sum")) == (2, 12)
    assert (added("request_max_num_generation_tokens_count"), added("request_max_num_generation_tokens_sum")) == (1, 6)
    phases = {name: added(f"request_{name}_time_seconds_sum") for name in ("prefill", "decode", "inference")}
    for name in phases:
        assert added(f"request_{name}_time_seconds_count") == 2, name
    assert phases["prefill"] > 0 and phases["decode"] > 0
    assert phases["inference"] == pytest.approx(phases["prefill"] + phases["decode"], rel=1e-9)
    assert added("request_time_per_output_token_seconds_count") == 2
    assert added("request_time_per_output_token_seconds_sum") == pytest.approx(phases["decode"] / 5, rel=1e-9)
    # each phase of a choice lies within its end-to-end latency, which the server measures from arrival
    assert phases["inference"] <= added("e2e_request_latency_seconds_sum")


def test_version_ping_and_model_retrieval(server, client, http):
    with httpx.Client(base_url=server.url) as anonymous:  # open, as /health is
        version = anonymous.get("/version")
        assert version.status_code == 200 and version.json() == {"version": importlib.metadata.version("jaxserve")}
        for method in ("GET", "POST"):
            ping = anonymous.request(method, "/ping")
            assert ping.status_code == 200 and ping.json() == {"status": "ok"}, method
        for path in ("/invocations", f"/v1/models/{MODEL}"):  # these stay behind the key, as /v1 does
            assert anonymous.request("POST" if path == "/invocations" else "GET", path).status_code == 401, path
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_dump()["max_model_len"] == CONFIG.max_model_len
    assert http.get(f"/v1/models/{MODEL}").json() == http.get("/v1/models").json()["data"][0]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("org/other-model")
    missing = http.get("/v1/models/org/other-model").json()["error"]
    assert missing["code"] == 404 and missing["param"] == "model" and "org/other-model" in missing["message"]


def test_invocations_dispatch_to_chat_or_completions(http):
    chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
    completion = http.post("/invocations", json={"prompt": "Hi", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion", completion.text
    neither = http.post("/invocations", json={"max_tokens": 2})
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"
    bad_chat = http.post("/invocations", json={"messages": "Hi"})
    assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "messages"


def test_auth(server):
    body = {"prompt": "Hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}):
        response = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "AuthenticationError"
    assert httpx.post(server.url + "/v1/completions", json=body, headers=AUTH).status_code == 200


# ---- bad inputs: 400 with the field named ------------------------------------------------------------------------

COMPLETION_BAD = [
    ({"prompt": 123}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, VOCAB]}, "prompt"),  # the vocabulary is [0, VOCAB)
    ({"prompt": [1, -3]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": ["a", [1, 2]]}, "prompt"),  # a batch is of one kind
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [[1, 2], [3, "x"]]}, "prompt"),
    ({"prompt": ["Hi", ""]}, "prompt"),
    ({"prompt": [[1, 2], [1, VOCAB]]}, "prompt"),  # a refused prompt refuses the whole batch
    ({"prompt": list(range(2, 302))}, "prompt"),  # longer than the context on its own
    ({"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),  # without echo
    ({"prompt": "Hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "Hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "Hi", "top_k": 2.5}, "top_k"),
    ({"prompt": "Hi", "seed": "x"}, "seed"),
    ({"prompt": "Hi", "seed": 2**70}, "seed"),
    ({"prompt": "Hi", "stop": 5}, "stop"),
    ({"prompt": "Hi", "stop": [""]}, "stop"),
    ({"prompt": "Hi", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"prompt": "Hi", "stop_token_ids": "1"}, "stop_token_ids"),
    ({"prompt": "Hi", "ignore_eos": "no"}, "ignore_eos"),
    ({"prompt": "Hi", "stream": "yes"}, "stream"),
    ({"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "Hi", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": "Hi", "return_token_ids": "yes"}, "return_token_ids"),
    ({"prompt": "Hi", "model": 7}, "model"),
]
CHAT_BAD = [
    ({}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}, "max_completion_tokens"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"thinking": "yes"}},
        "chat_template_kwargs.thinking",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice"),  # no tools
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "tools": None}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
]


@pytest.mark.parametrize(
    "path, body, field",
    [("/v1/completions", b, f) for b, f in COMPLETION_BAD] + [("/v1/chat/completions", b, f) for b, f in CHAT_BAD],
)
def test_bad_input_is_a_400_naming_the_field(http, path, body, field):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == field
    assert field in error["message"]


def test_context_overflow_uses_the_wording_clients_match(http):
    error = http.post("/v1/completions", json={"prompt": list(range(2, 202)), "max_tokens": 100}).json()["error"]
    assert error["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested 300 tokens (200 in the "
        "messages, 100 in the completion). Please reduce the length of the messages or completion."
    )


@pytest.mark.parametrize("content, what", [(b"{not json", "JSON"), (b"\xff\xfe", "JSON"), (b"", "JSON")])
def test_malformed_bodies_are_a_400(http, content, what):
    response = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400 and what in response.json()["error"]["message"]


def local_port(response: httpx.Response) -> int:
    """The client's port of the connection `response` came on."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/invocations", "/tokenize"])
def test_a_body_that_is_not_a_json_object_is_a_400_and_the_connection_stays_up(http, path):
    answers = []
    for content in (b"null", b"[1, 2]", b"3", b'"Hi"', b"true"):
        answers.append(http.post(path, content=content, headers={"content-type": "application/json"}))
        error = answers[-1].json()["error"]
        assert answers[-1].status_code == 400 and error["param"] == "body", (content, answers[-1].text)
        assert error["message"].startswith("body: must be a JSON object"), error
    for content_type in ("application/x-www-form-urlencoded", "text/plain; charset=utf-8", "multipart/form-data"):
        answers.append(http.post(path, content=b"prompt=Hi", headers={"content-type": content_type}))
        assert answers[-1].status_code == 400 and content_type.split(";")[0] in answers[-1].json()["error"]["message"]
    answers.append(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}))
    assert answers[-1].status_code == 200
    assert len({local_port(answer) for answer in answers}) == 1  # every refusal kept the connection alive


def test_an_empty_model_name_is_the_served_model_and_an_unknown_one_a_404(http):
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        served = http.post(path, json={**body, "model": "", "max_tokens": 1})
        assert served.status_code == 200 and served.json()["model"] == MODEL, served.text
        unknown = http.post(path, json={**body, "model": "gpt-4", "max_tokens": 1})
        assert unknown.status_code == 404 and unknown.json()["error"] == {
            "message": "The model `gpt-4` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }


def test_unknown_route_and_method_keep_the_error_shape(http):
    assert http.get("/v1/nothing").json()["error"]["code"] == 404
    assert http.get("/v1/completions").json()["error"]["code"] == 405


# ---- admission: 429, 503, token-id-only mode --------------------------------------------------------------------


def test_a_full_queue_answers_429_with_retry_after(server, runner, loaded, monkeypatch):
    gate, at_gate = threading.Event(), threading.Event()
    before_each_decode(runner, monkeypatch, lambda: (at_gate.set(), gate.wait(30)))
    with (
        serving(runner, loaded, max_queued_requests=1) as queued,
        httpx.Client(base_url=queued.url, timeout=60) as http,
    ):
        body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as running:
            # `running` is prefilled, then the engine waits at the gate before its first decode step; the next
            # request can only wait for admission, and the one after finds the queue full.
            assert at_gate.wait(30), "the first request never reached its first decode step"
            with http.stream("POST", "/v1/completions", json=body) as waiting:
                refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=10)
                gate.set()
                assert len(sse_payloads(waiting.iter_lines())) == 4
            assert len(sse_payloads(running.iter_lines())) == 4
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "RateLimitError" and "queue is full" in refused.json()["error"]["message"]


def test_health_is_503_while_loading_and_while_draining(server, runner, loaded):
    with serving(runner, loaded, start=False) as loading:
        health = httpx.get(loading.url + "/health")
        refused = httpx.post(loading.url + "/v1/completions", json={"prompt": "Hi"})
        assert health.status_code == 503 and health.json()["error"]["message"] == "Loading model"
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        # Every route says the same while loading (a model list would promise what cannot answer yet), but the
        # metrics stay up for the scrapers.
        for path in ("/v1/models", "/v1/nothing"):
            assert httpx.get(loading.url + path).json()["error"] == health.json()["error"], path
        assert httpx.get(loading.url + "/metrics").status_code == 200
    with serving(runner, loaded) as draining:
        assert httpx.get(draining.url + "/health").status_code == 200
        assert draining.engine.drain(timeout=5) == 0
        assert httpx.get(draining.url + "/health").status_code == 503
        assert httpx.post(draining.url + "/v1/completions", json={"prompt": "Hi"}).status_code == 503


# ---- big bodies: bounded, and never decoded or tokenized on the event loop ----------------------------------------


def test_big_bodies_are_refused_without_stalling_a_running_stream(server, runner, monkeypatch):
    # Decode steps of 25 ms or more: the gap criterion then allows the few ms a body's JSON parse or a tokenizer
    # call holds the interpreter lock, even on a busy machine, while tokenizing a 4 MiB prompt on the event loop
    # (seconds) still fails it.
    before_each_decode(runner, monkeypatch, lambda: time.sleep(0.025))
    limit = ServerConfig().max_request_bytes
    over = json.dumps({"prompt": "word " * (5_000_000 // 5)}).encode()  # 5 MB
    # Just under the limit, and far too long for the 256-token context.
    under = json.dumps({"prompt": "river " * ((limit - 100) // 6), "max_tokens": 1}).encode()
    assert len(over) > limit > len(under) > limit - 200
    arrivals: list[float] = []
    tokens_flowing = threading.Event()

    def victim() -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 30:
                        tokens_flowing.set()

    thread = threading.Thread(target=victim)
    thread.start()
    assert tokens_flowing.wait(60)
    answers = {}
    with httpx.Client(base_url=server.url, headers={**AUTH, "content-type": "application/json"}, timeout=60) as http:
        for name, body in (("over", over), ("under", under), ("over again", over), ("under again", under)):
            answers[name] = http.post("/v1/completions", content=body)
    # Declared 5 MB, sent 64 KB: the answer comes without the rest of the body.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        raw.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000000\r\n\r\n" + b" " * 65536
        )
        head = raw.recv(65536)
    done_during_the_stream = len(arrivals)
    thread.join(timeout=120)

    assert head.startswith(b"HTTP/1.1 413 ")
    for name, response in answers.items():
        error = response.json()["error"]
        if name.startswith("over"):
            assert response.status_code == 413 and error["type"] == "RequestTooLargeError" and error["code"] == 413
            assert f"{len(over)} bytes, more than the server's limit of {limit} bytes" in error["message"]
        else:
            assert response.status_code == 400 and error["param"] == "prompt"
            assert error["message"].startswith("This model's maximum context length is 256 tokens.")
    assert len(arrivals) == 250 and done_during_the_stream < 250  # the refusals came while it streamed
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert max(gaps) < 5 * statistics.median(gaps), (max(gaps), statistics.median(gaps))


def test_a_client_that_sends_its_whole_body_before_reading_gets_the_413(server):
    """Python's urllib sends all of a body before it reads the answer: the server reads and drops the rest of an
    over-limit body after refusing it (a lingering close), so the client reads the 413, not a connection reset."""
    limit = ServerConfig().max_request_bytes
    for size in (limit + 1, 5_000_000, 20_000_000):
        request = urllib.request.Request(
            server.url + "/v1/completions", data=b" " * size, headers={**AUTH, "Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 413, size
        error = json.loads(refused.value.read())["error"]
        assert error["message"].startswith(f"The request body is too large: {size} bytes"), error


def test_a_chunked_body_is_cut_off_at_the_limit(runner, loaded, server):
    sent = []

    def chunks():  # 64 MB offered, far more than the kernel's socket buffers hold
        for _ in range(1000):
            sent.append(65536)
            yield b" " * 65536

    with serving(runner, loaded, server_config=ServerConfig(max_request_bytes=10_000, log_stats_interval=0)) as small:
        response = httpx.post(small.url + "/v1/completions", content=chunks(), timeout=30)
    assert response.status_code == 413 and "more than the server's limit of 10000 bytes" in response.text
    assert sum(sent) < 1000 * 65536  # the server stopped reading; the client noticed before sending it all


def test_token_id_only_mode(server, runner, loaded):
    with (
        serving(runner, loaded, tokenizer=TokenIdOnly(default_checkpoint_path())) as ids_only,
        httpx.Client(base_url=ids_only.url, timeout=60) as http,
    ):
        for path, body, field in [
            ("/v1/completions", {"prompt": "Hello"}, "prompt"),
            ("/v1/completions", {"prompt": [5, 6], "stop": "x"}, "stop"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ]:
            response = http.post(path, json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == field
            assert field in response.json()["error"]["message"] and "tokenizer" in response.json()["error"]["message"]
        choice = http.post(
            "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
        ).json()["choices"][0]
    assert choice["text"] == "" and len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"


def test_an_engine_failure_mid_stream_is_an_error_event_then_done(server, http, runner, monkeypatch):
    def fail() -> None:
        raise RuntimeError("injected decode failure")

    before_each_decode(runner, monkeypatch, fail)
    body = {"prompt": "Hi", "max_tokens": 5, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        payloads = sse_payloads(response.iter_lines())
    assert response.status_code == 200 and payloads[-1] == "[DONE]"
    assert "injected decode failure" in payloads[-2]["error"]["message"] and payloads[-2]["error"]["code"] == 500
    assert "choices" in payloads[0]  # the first token came from the prefill step, before the failure

    whole = http.post("/v1/completions", json=body)
    assert whole.status_code == 500 and "injected decode failure" in whole.json()["error"]["message"]
    wait_for(lambda: settled(server.engine), SETTLE_S, "the failed requests' pages to return")


# ---- disconnects ---------------------------------------------------------------------------------------------------


def test_a_client_leaving_mid_stream_aborts_its_request_and_frees_its_pages(server, http, slow_decode):
    engine = server.engine
    free_before, aborted_before = engine.stats().free_pages, engine.stats().finished.get("abort", 0)
    body = {"prompt": list(range(2, 40)), "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine.stats().free_pages < free_before
    # Leaving the `with` closed the connection after one chunk of 200.
    wait_for(
        lambda: engine.stats().finished.get("abort", 0) == aborted_before + 1 and settled(engine),
        SETTLE_S,
        "the abort and the pages",
    )
    assert engine.stats().free_pages == free_before


def test_a_non_streaming_client_that_times_out_aborts_its_request(server, slow_decode):
    engine = server.engine
    aborted_before = engine.stats().finished.get("abort", 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions",
            headers=AUTH,
            timeout=0.5,
            json={"prompt": "Hi", "max_tokens": 200, "ignore_eos": True},
        )
    wait_for(
        lambda: engine.stats().finished.get("abort", 0) == aborted_before + 1 and settled(engine),
        SETTLE_S,
        "the abort and the pages",
    )


# ---- load ----------------------------------------------------------------------------------------------------------

LOAD_REQUESTS, LOAD_CONCURRENCY, LOAD_MAX_TOKENS, LOAD_CAP_S = 48, 16, 24, 60


async def _load(url: str, seed: int) -> dict:
    rng = random.Random(seed)
    plans = [
        (rng.randint(1, 200), rng.random() < 0.75, rng.choice([None, None, None, rng.randint(1, 10)]))
        for _ in range(LOAD_REQUESTS)
    ]  # (prompt length, stream, disconnect after this many chunks)
    gate = asyncio.Semaphore(LOAD_CONCURRENCY)
    results = {"statuses": [], "tokens": [], "gaps": [], "disconnects": 0, "health": []}
    done = asyncio.Event()

    async def one(http: httpx.AsyncClient, n: int, stream: bool, leave_after: int | None):
        body = {
            "prompt": [rng.randint(2, 511) for _ in range(n)],
            "max_tokens": LOAD_MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0.8,
            "stream": stream,
        }
        async with gate:
            if not stream:
                response = await http.post("/v1/completions", json=body)
                results["statuses"].append(response.status_code)
                if response.status_code == 200:
                    results["tokens"].append(response.json()["usage"]["completion_tokens"])
                return
            async with http.stream("POST", "/v1/completions", json=body) as response:
                results["statuses"].append(response.status_code)
                chunks, last = 0, time.perf_counter()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    if chunks:
                        results["gaps"].append(now - last)
                    chunks, last = chunks + 1, now
                    if chunks == leave_after:
                        results["disconnects"] += 1
                        return  # leaving the block closes the connection mid-stream
                results["tokens"].append(chunks)

    async def watch_health(http: httpx.AsyncClient):
        while not done.is_set():
            results["health"].append((await http.get("/health")).status_code)
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=LOAD_CAP_S) as http:
        watcher = asyncio.create_task(watch_health(http))
        await asyncio.wait_for(asyncio.gather(*(one(http, *plan) for plan in plans)), LOAD_CAP_S)
        done.set()
        await watcher
    return results


def test_load_with_random_disconnects(server):
    engine = server.engine
    started = time.perf_counter()
    results = asyncio.run(_load(server.url, seed=11))
    wall = time.perf_counter() - started
    wait_for(lambda: settled(engine), 10, "every page back after the load")
    gaps = sorted(results["gaps"])
    print(
        f"\nload: {LOAD_REQUESTS} requests, concurrency {LOAD_CONCURRENCY}, {results['disconnects']} disconnects, "
        f"{len(results['tokens'])} completed in {wall:.1f} s; inter-token latency p50 "
        f"{1000 * statistics.median(gaps):.1f} ms, p99 {1000 * gaps[int(0.99 * (len(gaps) - 1))]:.1f} ms"
    )
    assert all(status == 200 for status in results["statuses"]), results["statuses"]
    assert len(results["statuses"]) == LOAD_REQUESTS and results["disconnects"] > 0
    assert results["tokens"] and all(n == LOAD_MAX_TOKENS for n in results["tokens"])
    assert results["health"] and set(results["health"]) == {200}


# ---- priority scheduling ---------------------------------------------------------------------------------------


def test_a_priority_without_the_flag_is_a_400_naming_it(http):
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "priority": 0}).status_code == 200
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        response = http.post(path, json={**body, "max_tokens": 1, "priority": -1})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]


def test_priority_scheduling_admits_a_lower_priority_first_through_http(runner, loaded, monkeypatch):
    """One running request at a time; four of priority 0 arrive, then one of priority -1: it starts (its first token)
    before the three of priority 0 still waiting, which keep their arrival order."""
    gate, at_gate = threading.Event(), threading.Event()
    before_each_decode(runner, monkeypatch, lambda: (at_gate.set(), gate.wait(30)))
    first_token: dict[str, float] = {}

    def read(name, response):
        for line in response.iter_lines():
            if line.startswith("data: {"):
                first_token.setdefault(name, time.perf_counter())

    with (
        serving(runner, loaded, max_num_seqs=1, scheduling_policy="priority") as served,
        httpx.Client(base_url=served.url, timeout=60) as http,
        contextlib.ExitStack() as streams,
    ):

        def send(name, priority, max_tokens):
            body = {"prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "priority": priority}
            response = streams.enter_context(http.stream("POST", "/v1/completions", json=body))
            assert response.status_code == 200
            return threading.Thread(target=read, args=(name, response))

        readers = [send("running", 0, 8)]
        assert at_gate.wait(30), "the first request never reached its first decode step"
        # The engine waits at the gate: the next four are queued in the order they are sent.
        readers += [send(name, 0, 4) for name in ("b", "c", "d")] + [send("urgent", -1, 4)]
        for reader in readers:
            reader.start()
        gate.set()
        for reader in readers:
            reader.join(60)
    order = sorted(first_token, key=first_token.get)
    assert order == ["running", "urgent", "b", "c", "d"], order


def test_a_failed_engine_ends_running_streams_with_its_reason_and_answers_503(runner, loaded):
    """What a multi-process group's watch does when a process is lost (Engine.fail, from another thread, while the
    loop may be blocked in a step): the running stream gets one error event naming the reason, then [DONE]; /health
    and new requests answer 503 saying why."""
    reason = "lost process 1 of the group of 2: no heartbeat for 10 s (it died, hung, or its host is unreachable)"
    with serving(runner, loaded) as served:
        body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(line)
                    break
            served.engine.fail(reason)
            events += [line for line in lines if line.startswith("data: ")]
        errors = [json.loads(line[6:])["error"] for line in events if line.startswith('data: {"error"')]
        assert [error["message"] for error in errors] == [f"generation failed: {reason}"] and events[
            -1
        ] == "data: [DONE]"
        health = httpx.get(served.url + "/health", timeout=10)
        assert health.status_code == 503 and f"The engine stopped: {reason}" in health.text
        refused = httpx.post(served.url + "/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and not served.engine.is_running and served.engine.failure == reason
