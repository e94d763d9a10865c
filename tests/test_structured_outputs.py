"""Structured outputs through HTTP on the embedded default (random weights): whatever the model prefers, the text
must parse and validate, because only tokens the grammar allows are ever sampled (jaxserve.request.grammar, the
sampler's token masks). Also the field spellings (OpenAI's response_format, vLLM's structured_outputs and guided_*),
their errors, and the mask itself in the sampler."""

from __future__ import annotations

import dataclasses
import json
import re

import httpx
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import openai
import pytest
from served_runner import MODEL
from test_server import AUTH, serving

from jaxserve.request import SamplingParams
from jaxserve.request.grammar import mask_words
from jaxserve.runner.sampling import SamplingArrays, sample
from jaxserve.server.protocol import parse_chat
from jaxserve.text.chat import parse_output

S = {"type": "string", "maxLength": 8}
INT = {"type": "integer", "minimum": -50, "maximum": 50}
# 30 schemas: nested objects, arrays, enums, required fields, patterns, numbers with bounds.
SCHEMAS = [
    {"type": "object", "properties": {"a": INT}, "required": ["a"]},
    {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
        "required": ["name", "age"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["tags"]},
    {
        "type": "object",
        "properties": {"p": {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}},
        "required": ["p"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "point"}, "v": INT}, "required": ["kind", "v"]},
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "object", "properties": {"id": INT, "label": S}, "required": ["id"]},
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"n": {"type": ["integer", "null"], "minimum": 1, "maximum": 9}},
        "required": ["n"],
    },
    {
        "type": "object",
        "properties": {"mode": {"enum": [1, 2, 3]}, "flag": {"type": "boolean"}},
        "required": ["mode", "flag"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}},
        "required": ["email"],
    },
    {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["date"],
    },
    {
        "anyOf": [
            {"type": "object", "properties": {"a": INT}, "required": ["a"], "additionalProperties": False},
            {"type": "object", "properties": {"b": S}, "required": ["b"], "additionalProperties": False},
        ]
    },
    {
        "type": "object",
        "properties": {
            "matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "items": INT, "maxItems": 2}}
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {"t": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1}},
        "required": ["t"],
    },
    {
        "type": "object",
        "properties": {
            "level": {"enum": ["low", "medium", "high"]},
            "owner": {"type": "object", "properties": {"name": S}, "required": ["name"]},
        },
        "required": ["level", "owner"],
    },
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "integer", "minimum": 100, "maximum": 200},
    {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
        "required": ["xs"],
    },
    {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[0-9a-f]{4}$"}, "n": INT},
        "required": ["id", "n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": INT}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "currency": {"enum": ["EUR", "USD"]},
        },
        "required": ["price", "currency"],
    },
    {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["word"],
    },
    {"type": "object", "properties": {"u": {"type": "null"}, "v": {"type": "boolean"}}, "required": ["u", "v"]},
    {
        "type": "object",
        "properties": {
            "steps": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b"]}},
            "done": {"type": "boolean"},
        },
        "required": ["steps", "done"],
    },
    {
        "$defs": {"pt": {"type": "object", "properties": {"x": INT}, "required": ["x"]}},
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
        "required": ["from", "to"],
    },
    {
        "type": "object",
        "properties": {"status": {"enum": ["ok", "fail"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["status", "count"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def server(runner, loaded):
    with serving(runner, loaded) as served:
        yield served


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120)


def test_thirty_json_schemas_all_parse_and_validate(client):
    assert len(SCHEMAS) == 30
    for i, schema in enumerate(SCHEMAS):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Schema {i}"}],
            max_tokens=160,
            temperature=1.0,
            seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_regex_choice_and_grammar_through_both_apis(client, loaded):
    # Any JSON object has free keys, which random weights would spell out until max_tokens: a bias towards the
    # tokens that close strings and objects lets them end; the grammar alone makes the text valid JSON.
    tokenizer = loaded.tokenizer
    closers = {t: 10 for t in range(loaded.config.vocab_size) if set(tokenizer.decode([t]).strip()) & set('"}')}
    for seed in range(3):
        obj = client.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=120,
            seed=seed,
            logit_bias=closers,
            extra_body={"response_format": {"type": "json_object"}},
        )
        assert obj.choices[0].finish_reason == "stop", obj.choices[0].text
        assert isinstance(json.loads(obj.choices[0].text), dict)
        choice = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Pick"}],
            seed=seed,
            extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma delta"]}},
        )
        assert choice.choices[0].message.content in ("alpha", "beta", "gamma delta")
        regex = r"[a-c]{2,5}-[0-9]{3}"
        text = client.completions.create(
            model=MODEL, prompt="Code:", max_tokens=32, seed=seed, extra_body={"guided_regex": regex}
        ).choices[0]
        assert re.fullmatch(regex, text.text) and text.finish_reason == "stop", text
        grammar = 'start: "(" expr ")"\nexpr: NUM | NUM "+" expr\nNUM: /[0-9]/'
        expr = client.completions.create(
            model=MODEL, prompt="Sum:", max_tokens=48, seed=seed, extra_body={"guided_grammar": grammar}
        ).choices[0]
        assert expr.finish_reason == "stop" and re.fullmatch(r"\((\d\+)*\d\)", expr.text), expr


def test_constraints_with_streaming_n_logprobs_and_stop(client):
    schema = {"type": "object", "properties": {"v": {"enum": ["one", "two"]}, "n": INT}, "required": ["v", "n"]}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Go"}],
        n=2,
        stream=True,
        logprobs=True,
        top_logprobs=2,
        seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema, "strict": True}},
    )
    texts, logprobs = ["", ""], [0, 0]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            logprobs[c.index] += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
    for text, count in zip(texts, logprobs):
        jsonschema.validate(json.loads(text), schema)
        assert count > 0
    # A stop string cuts the constrained text where it matches.
    cut = client.completions.create(
        model=MODEL, prompt="x", seed=1, stop=["-"], extra_body={"guided_regex": "ab-cd"}, max_tokens=16
    )
    assert cut.choices[0].text == "ab" and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body, field",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_grammar": "start: foo"}, "guided_grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
    ],
)
def test_a_constraint_that_cannot_be_compiled_is_a_400_naming_it(server, body, field):
    reply = httpx.post(
        server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", **body}, headers=AUTH, timeout=60
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.text


def test_the_sampler_samples_only_allowed_tokens():
    vocab, rows = 70, 3
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(rows, vocab)), jnp.float32)
    allowed = np.zeros((rows, mask_words(vocab)), np.int32)
    choices = [[5], [33, 64, 69], list(range(vocab))]
    for r, tokens in enumerate(choices):
        for t in tokens:
            allowed[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    for temperature in (0.0, 1.0):
        for seed in range(20):
            params = SamplingArrays(
                temperature=jnp.full(rows, temperature),
                top_k=jnp.full(rows, -1, jnp.int32),
                top_p=jnp.ones(rows),
                min_p=jnp.zeros(rows),
                seed=jnp.full(rows, seed, jnp.uint32),
                position=jnp.ones(rows, jnp.int32),
                bias_ids=jnp.full((rows, 1), 2**31 - 1, jnp.int32),
                bias=jnp.zeros((rows, 1)),
                allowed=jnp.asarray(allowed),
            )
            tokens = np.asarray(jax.jit(sample)(logits, params))
            assert all(int(t) in allowed_ids for t, allowed_ids in zip(tokens, choices))
    # With every token allowed, the greedy token is the plain argmax.
    params = dataclasses.replace(params, allowed=jnp.full_like(allowed, -1), temperature=jnp.zeros(rows))
    assert np.array_equal(np.asarray(jax.jit(sample)(logits, params)), np.argmax(np.asarray(logits), axis=-1))


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_a_forced_tool_calls_arguments_validate_against_its_schema(server, loaded, tool_choice):
    # The chat request's forced tool call becomes this constraint (parse_chat); the tools section of a real chat
    # prompt (~1,000 tokens) does not fit this runner's context, so the engine gets a short prompt directly.
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": tool_choice}
    chat = parse_chat(body)
    assert chat.params.constraint is not None and chat.params.constraint.field == "tool_choice"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(4):
        sampling = SamplingParams(max_tokens=240, seed=seed, constraint=chat.params.constraint)  # 1 char a token
        tokens, reason, _ = server.engine.submit(loaded.tokenizer.encode("Weather?"), sampling).wait(timeout=120)
        assert reason == "stop", loaded.tokenizer.decode(tokens)
        parsed = parse_output(loaded.tokenizer.decode(tokens), chat.options)  # it reads the prefix itself
        assert parsed.calls(), loaded.tokenizer.decode(tokens)
        for call in parsed.calls():
            if isinstance(tool_choice, dict):
                assert call.name == "weather"
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
