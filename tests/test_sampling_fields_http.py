"""SamplingParams is the one definition of a request's sampling parameters: every field a client sends under its own
name as a plain JSON value reaches the engine through both endpoints, and a wrong type is a 400 naming it, with no
list of them in the server (server/protocol.py reads them from the dataclass). Against a real uvicorn and the real
engine over the fake runner (tests/fake_runner.py): nothing compiles."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from fake_runner import FakeRunner
from test_server import serve_app

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.config import EngineConfig, load_config
from jaxserve.engine import Engine
from jaxserve.model.cache import kv_geometry
from jaxserve.request import SamplingParams
from jaxserve.runner import Buckets
from jaxserve.server import create_app
from jaxserve.server.protocol import PLAIN_SAMPLING_FIELDS, SHAPED_SAMPLING_FIELDS
from jaxserve.text.tokenizer import load_tokenizer

MODEL = "tiny-v4"
# Every field but those the server shapes itself: a new one is here without a change in the server or this test.
PLAIN = [f for f in dataclasses.fields(SamplingParams) if f.name not in SHAPED_SAMPLING_FIELDS]
ENDPOINTS = {
    "/v1/completions": {"prompt": "Hello"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}]},
}


@pytest.fixture(scope="module")
def served():
    tokenizer = load_tokenizer(default_checkpoint_path())
    cfg = EngineConfig(max_num_seqs=4, chunked_prefill_size=256, max_prefill_rows=1, page_size=16, max_model_len=512)
    model_cfg = load_config(default_checkpoint_path())
    runner = FakeRunner(kv_geometry(cfg, model_cfg), Buckets.for_config(cfg), model_cfg.vocab_size)
    engine = Engine(cfg, model_cfg, runner, tokenizer.eos_ids, tokenizer.grammar_compiler(model_cfg.vocab_size)).start()
    try:
        with serve_app(create_app(engine, tokenizer, MODEL), engine) as server:
            yield server
    finally:
        engine.shutdown()


@pytest.fixture
def submitted(served, monkeypatch) -> list[SamplingParams]:
    """The SamplingParams of every request the server submits to the engine."""
    seen: list[SamplingParams] = []
    submit = served.engine.submit

    def recording(prompt_ids, sampling, *args, **kwargs):
        seen.append(sampling)
        return submit(prompt_ids, sampling, *args, **kwargs)

    monkeypatch.setattr(served.engine, "submit", recording)
    return seen


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=30) as client:
        yield client


def non_default(field: dataclasses.Field) -> object:
    """A valid JSON value for `field` that is not its default (with max_tokens 2, for min_tokens)."""
    kind = PLAIN_SAMPLING_FIELDS[field.name].kind
    if kind is bool:
        return not field.default
    if kind is int:
        return (field.default or 0) + 1
    if kind is float:
        return 0.5 if field.default != 0.5 else 0.25
    return [3, 5]  # token ids


def test_every_field_but_the_shaped_ones_is_read_as_plain():
    assert set(PLAIN_SAMPLING_FIELDS) == {f.name for f in PLAIN}
    assert SHAPED_SAMPLING_FIELDS <= {f.name for f in dataclasses.fields(SamplingParams)}, "a shaped field is gone"


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("field", PLAIN, ids=lambda f: f.name)
def test_a_plain_sampling_field_reaches_the_engine(http, submitted, path, field):
    value = non_default(field)
    response = http.post(path, json={"model": MODEL, "max_tokens": 2, **ENDPOINTS[path], field.name: value})
    assert response.status_code == 200, response.text
    [sampling] = submitted
    expected = tuple(value) if isinstance(value, list) else value
    assert getattr(sampling, field.name) == expected != field.default
    # Nothing else moved off its default.
    for other in PLAIN:
        if other.name != field.name:
            assert getattr(sampling, other.name) == other.default, other.name


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("field", PLAIN, ids=lambda f: f.name)
def test_a_plain_sampling_field_of_the_wrong_type_is_a_400_naming_it(http, submitted, path, field):
    response = http.post(path, json={"model": MODEL, "max_tokens": 2, **ENDPOINTS[path], field.name: "x"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field.name, response.text
    assert error["message"].startswith(f"{field.name}: must be "), error["message"]
    assert submitted == []
