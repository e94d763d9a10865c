"""Tool calls, reasoning and the tokenizer endpoints over HTTP, with the openai client and raw httpx, against a
real uvicorn and the real engine over the fake runner with a scripted model (tests/fake_runner.py): the model's
output is written out as DSML text and sent as the tokens of that text, so the whole text layer is exercised
without compiling a model."""

from __future__ import annotations

import contextlib
import json

import httpx
import numpy as np
import openai
import pytest
from fake_runner import FakeRunner, ScriptedModel
from test_chat_encoding import CALLS, CALLS_DSML, TOOLS
from test_server import serve_app

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.config import EngineConfig, load_config
from jaxserve.engine import Engine
from jaxserve.model.cache import kv_geometry
from jaxserve.request.grammar import mask_words
from jaxserve.runner import Buckets
from jaxserve.server import create_app
from jaxserve.server.protocol import parse_chat
from jaxserve.text.chat import chat_options, render_prompt
from jaxserve.text.tokenizer import load_tokenizer

MODEL = "tiny-v4"
QUESTION = [{"role": "user", "content": "Weather in São Paulo and news?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_checkpoint_path())


@contextlib.contextmanager
def scripted_server(tokenizer, grammars: bool = True):
    """A server over the scripted model; `grammars` false: an engine that takes no structured output constraints."""
    cfg = EngineConfig(max_num_seqs=4, chunked_prefill_size=256, max_prefill_rows=1, page_size=16, max_model_len=2048)
    model_cfg = load_config(default_checkpoint_path())
    runner = FakeRunner(
        kv_geometry(cfg, model_cfg), Buckets.for_config(cfg), model_cfg.vocab_size, ScriptedModel(tokenizer.eos_ids[0])
    )
    compiler = tokenizer.grammar_compiler(model_cfg.vocab_size) if grammars else None
    engine = Engine(cfg, model_cfg, runner, tokenizer.eos_ids, compiler).start()
    try:
        with serve_app(create_app(engine, tokenizer, MODEL), engine) as server:
            yield server
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def served(tokenizer):
    with scripted_server(tokenizer) as server:
        yield server


@pytest.fixture
def engine(served):
    """The scripted model: `scripts` holds the next answers, `prompts` what the engine fed it."""
    model = served.engine.runner.model
    model.scripts.clear()
    return model


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=30) as client:
        yield client


def script(engine, tokenizer, text: str) -> None:
    engine.scripts.append(tokenizer.encode(text, add_special_tokens=False))


def streamed(chunks) -> dict:
    """The chunks of one streamed choice put together as OpenAI's clients do, keeping every delta seen."""
    out = {"content": "", "reasoning_content": "", "tool_calls": {}, "finish_reason": None, "deltas": []}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta.model_dump(exclude_none=True)
        out["deltas"].append(delta)
        out["content"] += delta.get("content", "")
        out["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = out["tool_calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.get("id") or entry["id"]
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call.get("function", {}).get("arguments", "")
        out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


def test_a_tool_call_round_trip_non_streaming(client, engine, tokenizer):
    script(engine, tokenizer, "Let me check.\n\n" + CALLS_DSML)
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.role == "assistant" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", name, args) for name, args in CALLS
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    # The engine got the release's encoding of the messages with the tools.
    assert engine.prompts[-1] == tokenizer.encode(
        render_prompt(QUESTION, chat_options(tools=TOOLS)), add_special_tokens=False
    )
    assert "## Tools" in tokenizer.decode(engine.prompts[-1])

    # The client sends the calls and their results back: the next prompt renders them as the encoding does.
    history = (
        QUESTION
        + [choice.message.model_dump(exclude_none=True)]
        + [{"role": "tool", "tool_call_id": c.id, "content": f"result {k}"} for k, c in enumerate(calls)]
    )
    script(engine, tokenizer, "Sunny; no news.")
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("Sunny; no news.", "stop")
    assert answer.choices[0].message.tool_calls is None
    prompt = tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith(
        "Let me check.\n\n" + CALLS_DSML + "<｜end▁of▁sentence｜><｜User｜>"
        "<tool_result>result 0</tool_result>\n\n<tool_result>result 1</tool_result>"
        "<｜Assistant｜></think>"
    )


def test_a_tool_call_round_trip_streaming(client, engine, tokenizer):
    script(engine, tokenizer, "Let me check.\n\n" + CALLS_DSML)
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    out = streamed(chunks)
    assert out["content"] == "Let me check." and out["reasoning_content"] == ""
    assert out["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(out["tool_calls"].items())] == CALLS
    assert all(c["id"].startswith("call_") for c in out["tool_calls"].values())
    assert not any("DSML" in d.get("content", "") for d in out["deltas"])
    # The grammar that holds the calls is complete at the block's closing tag, which ends the answer: no EOS step.
    assert chunks[-1].usage.completion_tokens == len(tokenizer.encode("Let me check.\n\n" + CALLS_DSML))


def test_reasoning_arrives_apart_from_the_answer(client, engine, tokenizer):
    kwargs = {"chat_template_kwargs": {"thinking": True, "reasoning_effort": "max"}}
    text = "The user wants 2+2… 🤔</think>It is 4."
    script(engine, tokenizer, text)
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body=kwargs)
    message = response.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == ("It is 4.", "The user wants 2+2… 🤔")
    reasoning_tokens = len(tokenizer.encode("The user wants 2+2… 🤔", add_special_tokens=False))
    assert response.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]  # vLLM's current name
    prompt = tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert prompt.startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum") and prompt.endswith("<think>")

    script(engine, tokenizer, text)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, extra_body=kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    out = streamed(chunks)
    assert (out["reasoning_content"], out["content"], out["finish_reason"]) == (
        "The user wants 2+2… 🤔",
        "It is 4.",
        "stop",
    )
    assert not any("think>" in d.get("content", "") + d.get("reasoning_content", "") for d in out["deltas"])
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in out["deltas"])

    # The client passes its reasoning back: after the last user turn it is rendered, before it dropped.
    history = QUESTION + [{"role": "assistant", "content": "It is 4.", "reasoning_content": "2+2"}]
    script(engine, tokenizer, "ok")
    client.chat.completions.create(
        model=MODEL, messages=history + [{"role": "user", "content": "Sure?"}], extra_body=kwargs
    )
    assert "2+2</think>" not in tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    script(engine, tokenizer, "ok")
    client.chat.completions.create(
        model=MODEL, messages=history + [{"role": "user", "content": "Sure?"}], tools=TOOLS, extra_body=kwargs
    )  # with tools, every turn keeps its reasoning
    assert "<think>2+2</think>It is 4." in tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)


def test_continue_final_message_leaves_the_assistant_message_open_in_chat_and_tokenize(http, engine, tokenizer):
    started = QUESTION + [{"role": "assistant", "content": "Once upon", "reasoning_content": "a story"}]
    body = {"messages": started, "continue_final_message": True, "add_generation_prompt": False}
    ids = http.post("/tokenize", json={**body, "chat_template_kwargs": {"thinking": True}}).json()["tokens"]
    rendered = tokenizer.decode(ids, skip_special_tokens=False)
    assert rendered.endswith("<｜Assistant｜><think>a story</think>Once upon"), rendered  # not closed by EOS
    script(engine, tokenizer, " a time.")
    reply = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"thinking": True}}).json()
    assert engine.prompts[-1] == ids and reply["choices"][0]["message"]["content"] == " a time."  # no reasoning


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_leaves_the_reasoning_out(http, engine, tokenizer, stream):
    script(engine, tokenizer, "Hidden thoughts</think>It is 4.")
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "chat_template_kwargs": {"thinking": True},
        "include_reasoning": False,
        "stream": stream,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in response.text.split("\n\n")[1:-2]]
        content = "".join(d.get("content", "") for d in deltas)
        assert not any("reasoning" in d or "reasoning_content" in d for d in deltas), deltas
    else:
        message = response.json()["choices"][0]["message"]
        content = message["content"]
        assert "reasoning" not in message and "reasoning_content" not in message, message
    assert content == "It is 4." and "Hidden" not in response.text


def test_a_named_tool_choice_is_forced_and_parsed(client, engine, tokenizer):
    script(
        engine,
        tokenizer,
        '<｜DSML｜parameter name="city" string="true">Lima</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    )
    choice = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Lima"})
    ]
    assert tokenizer.decode(engine.prompts[-1]).endswith('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n')


def test_a_call_the_grammar_completes_on_the_last_token_max_tokens_allows_is_whole_not_cut(client, engine, tokenizer):
    """The grammar is complete at the block's closing tag, as EOS would end it: on the last token max_tokens allows
    the answer is whole (finish_reason tool_calls), one token short it is cut (length)."""
    answer = (
        '<｜DSML｜parameter name="city" string="true">Lima</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    named = {"type": "function", "function": {"name": "get_weather"}}
    length = len(tokenizer.encode(answer, add_special_tokens=False))
    for max_tokens, finish in ((length, "tool_calls"), (length - 1, "length")):
        script(engine, tokenizer, answer)
        choice = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=named, max_tokens=max_tokens
        ).choices[0]
        assert choice.finish_reason == finish and choice.message.tool_calls[0].function.name == "get_weather"


# A tool schema as pydantic's model_json_schema() writes one: its parameters refer to root definitions.
ROUTE = {
    "name": "plan_route",
    "description": "A route between two points",
    "parameters": {
        "$defs": {
            "Point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            },
            "Mode": {"type": "string", "enum": ["walk", "drive"]},
        },
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/Point"},
            "end": {"$ref": "#/$defs/Point"},
            "mode": {"$ref": "#/$defs/Mode"},
        },
        "required": ["start", "end", "mode"],
    },
}


def _route_call(start: str, mode: str = '"walk"') -> str:
    return (
        f'<｜DSML｜parameter name="start" string="false">{start}</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="end" string="false">{"x": 3, "y": 4}</｜DSML｜parameter>\n'
        f'<｜DSML｜parameter name="mode" string="false">{mode}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "plan_route"}}])
def test_a_forced_call_holds_to_a_schema_with_defs_and_refs(client, engine, tokenizer, tool_choice):
    """Forced (required, or named), the call's grammar compiles from a schema whose parameters are `$ref`s to its
    `$defs`, and holds the values to the definitions: a call that keeps to them is served, one that breaks them
    (a point's x as text, a mode not in the enum) is caught by the grammar as the model writes it."""
    prefix = '<｜DSML｜invoke name="plan_route">\n' if tool_choice == "required" else ""  # named: the prompt opens it
    tools = [{"type": "function", "function": ROUTE}]
    script(engine, tokenizer, prefix + _route_call('{"x": 1, "y": 2}'))
    choice = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, tool_choice=tool_choice)
    call = choice.choices[0].message.tool_calls[0]
    assert choice.choices[0].finish_reason == "tool_calls" and call.function.name == "plan_route"
    assert json.loads(call.function.arguments) == {"start": {"x": 1, "y": 2}, "end": {"x": 3, "y": 4}, "mode": "walk"}
    for start, mode in (('{"x": "one", "y": 2}', '"walk"'), ('{"x": 1, "y": 2}', '"fly"')):
        script(engine, tokenizer, prefix + _route_call(start, mode))
        with pytest.raises(openai.InternalServerError, match="structured output"):
            client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, tool_choice=tool_choice)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_in_thinking_mode_comes_after_the_reasoning(client, engine, tokenizer, tool_choice, stream):
    """As vLLM does: the model reasons first, then the grammar holds it to the call (the prompt opens nothing but the
    reasoning); an answer that is not the call is caught as the model writes it."""
    thinking = {"chat_template_kwargs": {"thinking": True}}
    call = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Lima</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    script(engine, tokenizer, "Which city? Lima.</think>" + call)
    create = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, extra_body=thinking)
    if stream:
        out = streamed(client.chat.completions.create(**create, stream=True))
        reasoning, content, finish = out["reasoning_content"], out["content"], out["finish_reason"]
        calls = [(c["name"], json.loads(c["arguments"])) for c in out["tool_calls"].values()]
    else:
        choice = client.chat.completions.create(**create).choices[0]
        reasoning, content, finish = (
            choice.message.model_extra["reasoning_content"],
            choice.message.content,
            choice.finish_reason,
        )
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert (reasoning, content or "", finish) == ("Which city? Lima.", "", "tool_calls")
    assert calls == [("get_weather", {"city": "Lima"})]
    assert tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith("<｜Assistant｜><think>")
    script(engine, tokenizer, "Which city? Lima.</think>It is sunny in Lima.")
    with pytest.raises(openai.InternalServerError, match="structured output"):
        client.chat.completions.create(**create)


def test_a_forced_answer_may_write_optional_parameters_or_leave_them_out_and_call_several_tools(
    client, engine, tokenizer
):
    """The forced grammar against the release's DSML: an optional parameter after a required one (days), a call
    whose first parameter is left out (search with filters only), two calls in one block."""
    script(engine, tokenizer, CALLS_DSML.removeprefix("<｜DSML｜tool_calls>\n"))
    forced = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in forced.choices[0].message.tool_calls] == CALLS
    script(
        engine,
        tokenizer,
        '<｜DSML｜parameter name="filters" string="false">{"site": ["a.org"]}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    )
    named = {"type": "function", "function": {"name": "search"}}
    call = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=named)
    (only,) = call.choices[0].message.tool_calls
    assert (only.function.name, json.loads(only.function.arguments)) == ("search", {"filters": {"site": ["a.org"]}})


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_writes_one_call_and_without_a_grammar_returns_the_first(
    client, engine, tokenizer, stream
):
    """OpenAI's parallel_tool_calls false: the grammar that holds the calls (auto or forced) allows one invoke, so a
    second is caught as the model writes it; where the request's own structured output replaces that grammar, an
    answer that writes two calls gives the first."""
    one_only = {"parallel_tool_calls": False}
    anything = {"structured_outputs": {"regex": "(?s:.*)"}}  # the request's own constraint: no tool grammar
    script(engine, tokenizer, "Let me check.\n\n" + CALLS_DSML)
    create = dict(model=MODEL, messages=QUESTION, tools=TOOLS, extra_body={**one_only, **anything})
    if stream:
        out = streamed(client.chat.completions.create(**create, stream=True))
        calls = [(c["name"], json.loads(c["arguments"])) for c in out["tool_calls"].values()]
        content, finish = out["content"], out["finish_reason"]
    else:
        choice = client.chat.completions.create(**create).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        content, finish = choice.message.content, choice.finish_reason
    assert (calls, content, finish) == (CALLS[:1], "Let me check.", "tool_calls")
    block = CALLS_DSML.removeprefix("<｜DSML｜tool_calls>\n")
    first = block[: block.index("</｜DSML｜invoke>") + len("</｜DSML｜invoke>")]
    held = dict(model=MODEL, messages=QUESTION, tools=TOOLS, extra_body=one_only)
    for tool_choice, answer in (("auto", "Let me check.\n\n<｜DSML｜tool_calls>\n" + first), ("required", first)):
        script(engine, tokenizer, answer + "\n</｜DSML｜tool_calls>")
        choice = client.chat.completions.create(**held, tool_choice=tool_choice).choices[0]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS[:1]
        script(engine, tokenizer, answer + "\n" + block[len(first) + 1 :])
        with pytest.raises(openai.InternalServerError, match="structured output"):
            client.chat.completions.create(**held, tool_choice=tool_choice)


def test_tool_choice_none_neither_renders_nor_parses_tools(client, engine, tokenizer):
    script(engine, tokenizer, "No tools.")
    choice = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="none",
    ).choices[0]
    assert (choice.message.content, choice.finish_reason, choice.message.tool_calls) == ("No tools.", "stop", None)
    assert "## Tools" not in tokenizer.decode(engine.prompts[-1])


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_tool_output_is_caught_by_the_grammar_or_without_one_is_plain_content(
    client, engine, tokenizer, stream
):
    text = 'Trying.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\noops'
    script(engine, tokenizer, text)
    with pytest.raises((openai.InternalServerError, openai.APIError), match="structured output"):
        response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, stream=stream)
        if stream:
            list(response)
    script(engine, tokenizer, text)
    anything = {"structured_outputs": {"regex": "(?s:.*)"}}  # the request's own constraint: no tool grammar
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, stream=stream, extra_body=anything
    )
    if stream:
        out = streamed(response)
        assert (out["content"], out["tool_calls"], out["finish_reason"]) == (text, {}, "stop")
    else:
        choice = response.choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")


def test_a_tool_call_cut_by_max_tokens_ends_with_length_as_far_as_it_was_written(client, engine, tokenizer):
    """Held by the grammar, a call streams as it is written, so one cut short by max_tokens is returned as far as
    the model wrote it (finish_reason length), streamed and not alike; without the grammar the block is text."""
    answer = "Let me check.\n\n" + CALLS_DSML
    ids = tokenizer.encode(answer, add_special_tokens=False)
    opened = len(tokenizer.encode(answer[: answer.index("São")], add_special_tokens=False))
    cut = opened + 3  # tokens: inside the first call's string value
    written = tokenizer.decode(ids[:cut])
    city = written.split('string="true">')[1]
    assert city and city in 'São Paulo 東京 "quoted" \\ back'
    create = dict(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=cut)
    script(engine, tokenizer, answer)
    choice = client.chat.completions.create(**create).choices[0]
    (call,) = choice.message.tool_calls
    assert (choice.finish_reason, choice.message.content) == ("length", "Let me check.")
    assert (call.function.name, call.function.arguments) == (
        "get_weather",
        '{"city": ' + json.dumps(city, ensure_ascii=False)[:-1],
    )
    script(engine, tokenizer, answer)
    out = streamed(client.chat.completions.create(**create, stream=True))
    assert [(c["name"], c["arguments"]) for c in out["tool_calls"].values()] == [
        ("get_weather", call.function.arguments)
    ]
    assert out["finish_reason"] == "length"
    script(engine, tokenizer, answer)
    anything = {"structured_outputs": {"regex": "(?s:.*)"}}
    unheld = client.chat.completions.create(**create, extra_body=anything).choices[0]
    assert (unheld.finish_reason, unheld.message.tool_calls, unheld.message.content) == ("length", None, written)


BAD = [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"chat_template_kwargs": {"reasoning_effort": "extreme"}}, "chat_template_kwargs.reasoning_effort"),
    ({"reasoning_effort": "ultra"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": "on"}}, "chat_template_kwargs.enable_thinking"),
    ({"messages": [{"role": "tool", "content": "r"}]}, "messages"),
    (
        {
            "messages": QUESTION
            + [
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[]"}}]},
                {"role": "tool", "tool_call_id": "x", "content": "r"},
            ]
        },
        "messages",
    ),
]


@pytest.mark.parametrize("extra, field", BAD)
def test_bad_tool_and_reasoning_fields_are_a_400_naming_them(http, engine, extra, field):
    submitted = len(engine.prompts)
    response = http.post("/v1/chat/completions", json={"messages": QUESTION, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert len(engine.prompts) == submitted


@pytest.mark.parametrize(
    "role, message",
    [
        ("wizard", "messages[1]: role 'wizard' is not one of DeepSeek-V4's chat roles (system, developer, user, "),
        # the release's reminder role is rendered (tests/test_chat_encoding.py) where the tokenizer has its token,
        # which the embedded default's does not
        ("latest_reminder", "messages[1]: role 'latest_reminder' needs the <｜latest_reminder｜> token, which"),
    ],
)
def test_a_role_the_encoding_cannot_render_is_a_400_naming_the_message(client, engine, role, message):
    submitted = len(engine.prompts)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[*QUESTION, {"role": role, "content": "Be brief."}], max_tokens=4
        )
    error = refused.value.body
    assert error["param"] == "messages" and error["message"].startswith(message), error
    assert len(engine.prompts) == submitted


# ---- tokenizer endpoints ---------------------------------------------------------------------------------------------


def test_tokenize_detokenize_and_tokenizer_info(http, tokenizer, served):
    text = "Olá, 東京! <｜DSML｜x>"
    body = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    ids = tokenizer.encode(text)
    assert body == {
        "count": len(ids),
        "max_model_len": served.engine.context_limit,
        "tokens": ids,
        "token_strs": [tokenizer.id_to_token(i) for i in ids],
    }
    assert http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["token_strs"] is None
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    bos_eos = [tokenizer.bos_id, *ids, tokenizer.eos_ids[0]]
    assert http.post("/detokenize", json={"tokens": bos_eos}).json()["prompt"] == (
        "<｜begin▁of▁sentence｜>" + text + "<｜end▁of▁sentence｜>"
    )  # special tokens kept, as in vLLM

    chat = {"messages": QUESTION, "tools": TOOLS, "chat_template_kwargs": {"thinking": True}}
    assert http.post("/tokenize", json=chat).json()["tokens"] == tokenizer.apply_chat_template(
        QUESTION, chat_options(thinking=True, tools=TOOLS)
    )

    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"]) == ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
    # What lm-eval's remote tokenizer does with it: the EOS id is the encoding of the eos_token string.
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tokenizer.eos_ids[0]]


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": QUESTION}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        (
            "/tokenize",
            {"messages": QUESTION, "add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message",
        ),
        ("/tokenize", {"messages": QUESTION, "continue_final_message": True}, "messages"),  # the last is the user's
        ("/tokenize", {"messages": [{"role": "nobody"}]}, "messages"),
        ("/tokenize", {"messages": QUESTION, "tool_choice": "required"}, "tool_choice"),
        ("/detokenize", {"tokens": [1, 100000]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/tokenize", {"prompt": "a", "model": 3}, "model"),
    ],
)
def test_tokenizer_endpoints_refuse_bad_input_naming_the_field(http, path, body, field):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert http.post("/tokenize", json={"prompt": "a", "model": "other"}).status_code == 404


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
@pytest.mark.parametrize("thinking", [False, True])
def test_a_held_call_streams_its_name_first_then_its_arguments_as_the_model_writes_them(
    client, engine, tokenizer, thinking, tool_choice
):
    """The grammar holds the block (forced or auto), so each call streams as OpenAI's do: index, id, type and name
    in its first delta, then `arguments` fragments, the first of them long before the call's closing tag; the
    fragments add up to the non-streamed call's arguments, byte for byte."""
    text = "" if tool_choice == "required" else "Let me look."
    answer = (
        CALLS_DSML.removeprefix("<｜DSML｜tool_calls>\n") if tool_choice == "required" else text + "\n\n" + CALLS_DSML
    )
    if thinking:
        answer = "Two lookups.</think>" + (text + "\n\n" + CALLS_DSML)
    create = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice)
    if thinking:
        create["extra_body"] = {"chat_template_kwargs": {"thinking": True}}
    script(engine, tokenizer, answer)
    whole = client.chat.completions.create(**create).choices[0].message.tool_calls
    script(engine, tokenizer, answer)
    out = streamed(client.chat.completions.create(**create, stream=True))
    assert out["finish_reason"] == "tool_calls" and out["content"] == text
    assert out["reasoning_content"] == ("Two lookups." if thinking else "")
    assert [(c["name"], c["arguments"]) for _, c in sorted(out["tool_calls"].items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(out["tool_calls"].items())] == CALLS
    pieces = [(d["index"], d) for delta in out["deltas"] for d in delta.get("tool_calls", [])]
    for index in (0, 1):
        mine = [d for i, d in pieces if i == index]
        first, rest = mine[0], mine[1:]
        assert first["id"].startswith("call_") and first["type"] == "function"
        assert first["function"] == {"name": CALLS[index][0], "arguments": ""}
        assert rest and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
        # The arguments arrive in many pieces: the call's text was streamed before its closing tag was written.
        so_far = [sum(len(d["function"]["arguments"]) for d in rest[: k + 1]) for k in range(len(rest))]
        assert len(rest) > 5 and so_far[0] < so_far[-1] // 4


@pytest.mark.parametrize(
    "call",
    [
        '<｜DSML｜invoke name="fly">\n</｜DSML｜invoke>',  # no such tool
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>",  # city is required
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">"three"</｜DSML｜parameter>\n</｜DSML｜invoke>',  # an integer
        # Valid JSON, but not as DeepSeek's encoder writes it (json.dumps): whitespace left free lets a random model
        # pad an object until max_tokens (found by benchmarks/tool_calls.py).
        '<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="filters" string="false">{\n  "depth": 2}'
        "</｜DSML｜parameter>\n</｜DSML｜invoke>",
    ],
)
def test_under_auto_a_call_the_tools_do_not_allow_is_caught_as_the_model_writes_it(client, engine, tokenizer, call):
    script(engine, tokenizer, "Let me check.\n\n<｜DSML｜tool_calls>\n" + call + "\n</｜DSML｜tool_calls>")
    with pytest.raises(openai.InternalServerError, match="structured output"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS)


def test_an_engine_that_takes_no_constraints_serves_auto_tool_calls_parsed_whole(tokenizer, caplog):
    """Without a grammar (here no grammar compiler; likewise with speculative decoding) tools under auto still work:
    a block is held whole until it parses, said once in the log; a forced call is a 400 naming tool_choice."""
    with scripted_server(tokenizer, grammars=False) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = server.engine.runner.model
        for stream in (False, True):
            model.scripts.append(tokenizer.encode("Let me check.\n\n" + CALLS_DSML, add_special_tokens=False))
            response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, stream=stream)
            if stream:
                out = streamed(response)
                calls = [(c["name"], json.loads(c["arguments"])) for c in out["tool_calls"].values()]
                pieces = [d for delta in out["deltas"] for d in delta.get("tool_calls", [])]
                assert [d["id"] is not None for d in pieces] == [True, True]  # each call whole, in one piece
            else:
                message = response.choices[0].message
                calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
            assert calls == CALLS
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required")
    assert "no grammar holds tool calls" in caplog.text


def test_a_schema_no_value_satisfies_ends_the_answer_with_an_error_not_a_stop(client, engine, tokenizer):
    """A tool whose parameter refers only to itself: no value can be written, so llguidance's matcher fails while
    computing the mask after the parameter's opening tag. That matcher is stopped but its text is not complete: the
    answer ends with an error, never as a finished call (found by benchmarks/tool_calls.py, where such a call ended
    as "tool_calls" with empty arguments)."""
    looping = {"type": "object", "properties": {"x": {"$ref": "#/$defs/D"}}, "required": ["x"]}
    looping["$defs"] = {"D": {"$ref": "#/$defs/D"}}
    tools = [{"type": "function", "function": {"name": "loop", "parameters": looping}}]
    opened = '<｜DSML｜invoke name="loop">\n<｜DSML｜parameter name="x" string="false">'
    chat = parse_chat({"messages": QUESTION, "tools": tools, "tool_choice": "required"})
    vocab = load_config(default_checkpoint_path()).vocab_size
    matcher = tokenizer.grammar_compiler(vocab).matcher(chat.params.constraint)
    for token in tokenizer.encode(opened, add_special_tokens=False):
        assert matcher.accept(token) is None
    matcher.fill_mask(np.zeros(mask_words(vocab), np.int32))  # fails: nothing may follow
    assert not matcher.finished
    assert matcher.accept(tokenizer.eos_ids[0]) is not None
    script(engine, tokenizer, opened)  # then EOS, as the model that found this wrote it
    with pytest.raises(openai.InternalServerError, match="structured output"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, tool_choice="required")
