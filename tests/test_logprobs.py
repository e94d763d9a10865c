"""Logprobs, echo and n: the device functions against a plain log-softmax, then over HTTP on the embedded default
checkpoint in float32 against transformers' DeepSeek-V4 (tests/reference.py): every prompt position's logprob from
`echo` (a prompt longer than one prefill chunk), the greedy tokens and their logprobs on both endpoints, `n`
choices with seeds, and the validation of these fields."""

from __future__ import annotations

import httpx
import jax
import numpy as np
import pytest
from reference import load_reference, reference_greedy, reference_logprobs
from served_runner import MODEL
from test_server import serving, settled, sse_payloads, wait_for

import jaxserve.runner.logprobs as logprobs_module
from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.request import MAX_LOGPROBS
from jaxserve.runner.logprobs import prompt_logprobs, sampled_logprobs

TOL = 1e-4
VOCAB = 512
PROMPT = np.random.default_rng(16).integers(2, VOCAB, 100).tolist()  # 2 chunks of CONFIG.chunked_prefill_size


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# ---- the device functions ------------------------------------------------------------------------------------------


def test_device_logprobs_are_the_log_softmax_in_blocks_and_nothing_unless_asked(monkeypatch):
    # 3 rows x 11 positions with blocks of 8 // 3 = 2 positions: six blocks, the last one padded.
    monkeypatch.setattr(logprobs_module, "PROMPT_LOGITS_TOKENS", 8)
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(3, 11, 16)).astype(np.float32)
    head = rng.normal(size=(16, 50)).astype(np.float32)
    targets = rng.integers(0, 50, (3, 11)).astype(np.int32)
    expected = log_softmax(hidden @ head)
    best = np.argsort(-expected, axis=-1)[..., :MAX_LOGPROBS]

    out = jax.jit(prompt_logprobs, static_argnames="vocab_size")(
        hidden, head, targets, np.array([False, True, False]), vocab_size=50
    )
    np.testing.assert_allclose(out.token, np.take_along_axis(expected, targets[..., None], -1)[..., 0], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, best)
    np.testing.assert_allclose(out.top, np.take_along_axis(expected, best, -1), atol=1e-5)
    idle = jax.jit(prompt_logprobs, static_argnames="vocab_size")(
        hidden, head, targets, np.zeros(3, bool), vocab_size=50
    )
    assert not np.any(idle.token) and not np.any(idle.top) and not np.any(idle.top_ids)

    logits = hidden[:, -1] @ head
    tokens = targets[:, 0]
    out = jax.jit(sampled_logprobs)(logits, tokens)
    np.testing.assert_allclose(out.token, expected[np.arange(3), -1, tokens], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, best[:, -1])
    # The best token's own logprob is bit-equal to the top value (lm-eval's is_greedy compares them with ==).
    out = jax.jit(sampled_logprobs)(logits, out.top_ids[:, 0])
    np.testing.assert_array_equal(out.token, out.top[:, 0])


def test_sampled_logprobs_take_the_top_k_without_sorting_the_vocabulary():
    """Every step computes them: as a sort of the whole vocabulary (which XLA keeps when anything else reads the sort
    top_k starts as, and XLA:GPU for a top-k of more than 16) a decode step of the embedded default took 2.3 ms
    instead of 1.5 on CPU."""
    logits = jax.ShapeDtypeStruct((8, 4096), np.float32)
    tokens = jax.ShapeDtypeStruct((8,), np.int32)
    optimized = jax.jit(sampled_logprobs).lower(logits, tokens).compile().as_text()
    assert " sort(" not in optimized


@pytest.mark.parametrize("k", [16, 20, 37])
def test_the_top_k_in_calls_of_sixteen_is_lax_top_k_ties_and_all(k):
    # Values from a few levels, so most are tied: the order among ties (lower id first) must survive the calls.
    x = np.random.default_rng(k).integers(0, 6, (3, 300)).astype(np.float32)
    values, ids = jax.jit(logprobs_module._top_k, static_argnums=1)(x, k)
    expected_values, expected_ids = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(values, expected_values)


# ---- over HTTP, against the reference ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    return load_reference(default_checkpoint_path())


@pytest.fixture(scope="module")
def server(runner, loaded):
    with serving(runner, loaded) as server:
        yield server


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def complete(http, **body) -> dict:
    response = http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), name
    return int(name[len("token_id:") :])


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_gives_every_prompt_position_the_reference_log_softmax(http, reference, loaded, max_tokens):
    body = complete(
        http,
        prompt=PROMPT,
        echo=True,
        logprobs=5,
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        return_tokens_as_token_ids=True,
    )
    (choice,) = body["choices"]
    expected = reference_logprobs(reference, PROMPT)  # row p: the distribution of the token after position p
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + max_tokens
    assert [token_id(t) for t in logprobs["tokens"][: len(PROMPT)]] == PROMPT
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for p in range(1, len(logprobs["tokens"])):
        row = expected[p - 1]
        token = token_id(logprobs["tokens"][p])
        assert abs(logprobs["token_logprobs"][p] - row[token]) <= TOL, p
        top = {token_id(name): value for name, value in logprobs["top_logprobs"][p].items()}
        best = [int(i) for i in np.argsort(-row)[:5]]
        assert set(top) == set(best) | {token}, p  # the top 5 and the token itself
        assert all(abs(value - row[i]) <= TOL for i, value in top.items()), p
    if max_tokens:  # the generated token: the greedy one, with its logprob
        assert token_id(logprobs["tokens"][-1]) == int(np.argmax(expected[-1]))
    assert choice["text"].startswith(loaded.tokenizer.decode(PROMPT))
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": max_tokens,
        "total_tokens": len(PROMPT) + max_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},  # prompt logprobs run every prompt token
    }
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])


BOS_TEXT = "<｜begin▁of▁sentence｜>"


@pytest.mark.parametrize(
    "prompt",
    [[0, 46, 79, 0, 57, 134, 103], BOS_TEXT + "São Paulo" + BOS_TEXT + " – ünï"],
    ids=["ids-with-bos", "text-with-bos"],
)
def test_echo_offsets_index_the_text_returned_and_pieces_of_characters_keep_their_bytes(http, loaded, prompt):
    tokenizer = loaded.tokenizer
    body = complete(http, prompt=prompt, echo=True, logprobs=5, max_tokens=12, temperature=0, ignore_eos=True)
    choice = body["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    echo = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)  # an id prompt's BOS is not text
    assert text.startswith(echo) and len(logprobs["tokens"]) == len(ids) + 12
    pieces = 0
    offsets = logprobs["text_offset"]
    for k, token in enumerate(logprobs["tokens"]):
        if token.startswith("bytes:"):  # a piece of a character: its bytes, in OpenAI's notation
            pieces += 1
        elif k < len(ids) and token == BOS_TEXT and not isinstance(prompt, str):  # not in the text: takes no room
            assert offsets[k] == offsets[k + 1], k
        else:
            assert text[offsets[k] : offsets[k] + len(token)] == token, (k, token, offsets[k])
    assert pieces >= 2  # São and ünï are split inside their characters
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    # Pieces of characters no longer share the U+FFFD key: every position lists its 5 best, distinctly named.
    assert all(len(top) >= 5 for top in logprobs["top_logprobs"][1:]), logprobs["top_logprobs"]
    assert all(t in top for t, top in zip(logprobs["tokens"][1:], logprobs["top_logprobs"][1:]))


def test_greedy_tokens_and_their_logprobs_match_the_reference_streaming_and_not(http, reference):
    prompt = PROMPT[:20]
    tokens, rows = reference_greedy(reference, prompt, 8)
    args = dict(
        prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, return_tokens_as_token_ids=True
    )
    logprobs = complete(http, **args)["choices"][0]["logprobs"]
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "stream": True, **args}) as response:
        chunks = [p for p in sse_payloads(response.iter_lines()) if p != "[DONE]"]
    streamed = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in logprobs}
    # The second request finds the first's prompt pages in the prefix cache: both match the reference.
    for got in (logprobs, streamed):
        assert [token_id(t) for t in got["tokens"]] == tokens
        for i, (token, row) in enumerate(zip(tokens, rows)):
            assert abs(got["token_logprobs"][i] - row[token]) <= TOL, i
            top = {token_id(name): value for name, value in got["top_logprobs"][i].items()}
            assert set(top) == {int(t) for t in np.argsort(-row)[:3]}  # greedy: the token is the best of them
            assert all(abs(value - row[t]) <= TOL for t, value in top.items()), i
        assert got["text_offset"][0] == 0
    assert streamed["text_offset"] == logprobs["text_offset"] and streamed["tokens"] == logprobs["tokens"]


def test_chat_logprobs_are_the_reference_log_softmax_at_the_greedy_tokens(http, reference, loaded):
    response = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Where does the river run?"}],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 2,
            "return_token_ids": True,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    (choice,) = body["choices"]
    tokens, rows = reference_greedy(reference, body["prompt_token_ids"], 6)
    assert choice["token_ids"] == tokens
    content = choice["logprobs"]["content"]
    assert len(content) == 6
    for entry, token, row in zip(content, tokens, rows):
        assert entry["token"] == loaded.tokenizer.token_text(token)
        # A token's own bytes: a piece of a character is not U+FFFD's (the greedy run has such pieces).
        assert entry["bytes"] == list(loaded.tokenizer.token_bytes(token))
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]
        assert abs(entry["logprob"] - row[token]) <= TOL
        best = np.argsort(-row)[:2]
        assert [e["token"] for e in entry["top_logprobs"]] == [loaded.tokenizer.token_text(int(t)) for t in best]
        assert all(abs(e["logprob"] - row[t]) <= TOL for e, t in zip(entry["top_logprobs"], best))


def test_prompt_logprobs_are_the_reference_log_softmax_in_vllms_shape_in_both_apis(http, reference, loaded):
    prompt = PROMPT[:12]
    body = complete(http, prompt=prompt, prompt_logprobs=3, max_tokens=1, temperature=0, ignore_eos=True)
    entries = body["choices"][0]["prompt_logprobs"]
    expected = reference_logprobs(reference, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:], 1):
        row = expected[p - 1]
        best = [int(i) for i in np.argsort(-row)[:3]]
        assert set(entry) == {str(t) for t in best} | {str(prompt[p])}, p
        for key, value in entry.items():
            token = int(key)
            assert abs(value["logprob"] - row[token]) <= TOL, (p, token)
            true_rank = 1 + int((row > row[token]).sum())  # null past the MAX_LOGPROBS the device ranks
            assert value["rank"] == (true_rank if true_rank <= MAX_LOGPROBS else None), (p, token)
            assert value["decoded_token"] == loaded.tokenizer.token_text(token)
        assert [entry[str(t)]["rank"] for t in best] == [1, 2, 3]
    assert body["choices"][0]["logprobs"] is None  # not asked

    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    ).json()
    entries = chat["prompt_logprobs"]  # vLLM's place for them in a chat completion
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:]), entries  # k = 0: the token's own
    assert len(entries) == chat["usage"]["prompt_tokens"]


# ---- n -------------------------------------------------------------------------------------------------------------


def test_n_choices_are_seeded_reproducible_and_count_the_prompt_once(http, server):
    args = dict(prompt=PROMPT[:12], max_tokens=6, temperature=1.0, seed=1234, ignore_eos=True, return_token_ids=True)
    body = complete(http, n=3, **args)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    ids = [c["token_ids"] for c in choices]
    assert len({tuple(i) for i in ids}) == 3, ids  # distinct seeds, distinct samples
    assert body["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 18,
        "total_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 0},  # shorter than a page: nothing to share
    }
    assert [c["token_ids"] for c in complete(http, n=3, **args)["choices"]] == ids  # reproducible
    # Choice i is the request with seed + i.
    assert [complete(http, **{**args, "seed": 1234 + i})["choices"][0]["token_ids"] for i in range(3)] == ids

    with http.stream(
        "POST",
        "/v1/completions",
        json={"model": MODEL, "n": 3, "stream": True, "stream_options": {"include_usage": True}, **args},
    ) as r:
        chunks = [p for p in sse_payloads(r.iter_lines()) if p != "[DONE]"]
    streamed = {
        i: [t for c in chunks for choice in c["choices"] if choice["index"] == i for t in choice["token_ids"]]
        for i in range(3)
    }
    assert [streamed[i] for i in range(3)] == ids
    assert chunks[-1]["usage"] == body["usage"]

    chat = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "n": 2, "max_tokens": 3, "seed": 5, "messages": [{"role": "user", "content": "Hi"}]},
    ).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1] and chat["usage"]["completion_tokens"] <= 6
    wait_for(lambda: settled(server.engine), 5, "every page back")


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 99}], ids=["greedy", "seeded"])
def test_a_batch_of_prompts_gives_the_choices_of_the_single_calls_in_openai_order(http, server, sampling):
    prompts = [PROMPT[:5], PROMPT[10:13], PROMPT[20:28], PROMPT[40:44]]
    args = dict(max_tokens=4, ignore_eos=True, return_token_ids=True, **sampling)
    singles = [
        complete(http, prompt=p, **({**args, "seed": sampling["seed"] + j} if "seed" in sampling else args))
        for p in prompts
        for j in range(2)
    ]
    expected = [s["choices"][0]["token_ids"] for s in singles]
    if "seed" in sampling:  # the seeds differ, so the two choices of a prompt do too
        assert all(expected[2 * i] != expected[2 * i + 1] for i in range(4)), expected

    body = complete(http, prompt=prompts, n=2, **args)
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(8))
    assert [c["token_ids"] for c in choices] == expected  # index = prompt * n + choice
    assert [c["prompt_token_ids"] for c in choices] == [p for p in prompts for _ in range(2)]
    assert [c["text"] for c in choices] == [s["choices"][0]["text"] for s in singles]
    prompt_tokens = sum(len(p) for p in prompts)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 32,
        "total_tokens": prompt_tokens + 32,
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    with http.stream(
        "POST",
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompts,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            **args,
        },
    ) as response:
        chunks = [p for p in sse_payloads(response.iter_lines()) if p != "[DONE]"]
    streamed = [
        [t for c in chunks for ch in c["choices"] if ch["index"] == i for t in ch["token_ids"]] for i in range(8)
    ]
    assert streamed == expected and chunks[-1]["usage"] == body["usage"]
    wait_for(lambda: settled(server.engine), 5, "every page back")


# ---- validation ----------------------------------------------------------------------------------------------------

BAD = [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 2, "echo": True, "max_tokens": 0, "prompt": [5], "n": 0}, "n"),
    ("/v1/completions", {"echo": True, "logprobs": 30}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"echo": True, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"n": 129}, "n"),
    ("/v1/completions", {"n": 1.5}, "n"),
    ("/v1/completions", {"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
    ("/v1/chat/completions", {"echo": "yes"}, "echo"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's whole vocabulary: more than 20
    ("/v1/completions", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": "2"}, "prompt_logprobs"),
]


@pytest.mark.parametrize("path, fields, field", BAD)
def test_logprobs_echo_and_n_out_of_range_are_a_400_naming_the_field(http, path, fields, field):
    base = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    response = http.post(path, json={**base, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error


def test_a_refused_choice_aborts_the_ones_already_submitted(server, runner, loaded):
    # 4 slots and 2 queue places: at most 6 of the 10 choices are taken before the queue is full.
    with serving(runner, loaded, max_queued_requests=2) as busy:
        response = httpx.post(busy.url + "/v1/completions", json={"prompt": [5, 6], "n": 10}, timeout=30)
        assert response.status_code == 429, response.text
        assert busy.engine.drain(timeout=10) == 0  # the server aborted every choice it had submitted
        wait_for(lambda: settled(busy.engine), 5, "every page back")
        finished = busy.engine.counters.finished  # complete once drain() returned: counted before the finish
        assert list(finished) == ["abort"] and 2 <= finished["abort"] <= 6
