"""DeepSeek-V4's chat encoding and output parsing (jaxserve.text.chat), against the release's `encoding_dsv4.py` format:
the expected prompts and model outputs below are written out by hand from that encoder's templates, not produced
by the code under test. Streaming is checked by feeding each output split at every character and every byte."""

from __future__ import annotations

import codecs
import dataclasses
import json
import random

import pytest

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.text.chat import ChatOptions, ChatTemplateError, chat_options, parse_output, render_prompt
from jaxserve.text.chat.output import ChatOutputParser, ParsedDelta
from jaxserve.text.tokenizer import load_tokenizer

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"

WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
SEARCH = {
    "name": "search",
    "description": "Búsqueda — web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}},
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": SEARCH}]

# The release's tools section with these two tools, written out (TOOLS_TEMPLATE, schemas as one JSON line each).
TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}\n'
    '{"name": "search", "description": "Búsqueda — web", "parameters": {"type": "object", "properties": '
    '{"query": {"type": "string"}, "filters": {"type": "object"}}}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

# Two parallel calls, nested JSON and non-ASCII text in the arguments, as the model writes them.
CALLS_DSML = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">São Paulo 東京 "quoted" \\ back</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="search">\n'
    '<｜DSML｜parameter name="query" string="true">line one\nline <two> 🙂</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="filters" string="false">{"site": ["a.org", "b.org"], "depth": {"max": 2, '
    '"safe": true, "note": "ünï"}}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
CALLS = [
    ("get_weather", {"city": 'São Paulo 東京 "quoted" \\ back', "days": 3}),
    (
        "search",
        {
            "query": "line one\nline <two> 🙂",
            "filters": {"site": ["a.org", "b.org"], "depth": {"max": 2, "safe": True, "note": "ünï"}},
        },
    ),
]
OPENAI_CALLS = [
    {
        "id": f"call_{k}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }
    for k, (name, args) in enumerate(CALLS)
]


# ---- rendering -----------------------------------------------------------------------------------------------------


def test_tools_go_into_the_system_turn_and_a_tool_round_trip_renders_back():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and news?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two lookups.", "tool_calls": OPENAI_CALLS},
        # Results come back out of order; the encoding puts them in the order of the calls.
        {"role": "tool", "tool_call_id": "call_1", "content": "news: none"},
        {
            "role": "tool",
            "tool_call_id": "call_0",
            "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "25C"}],
        },
        {"role": "user", "content": "Thanks, and?"},
    ]
    expected_turn = (
        "Checking.\n\n"
        + CALLS_DSML
        + EOS
        + USER
        + "<tool_result>sunny\n\n25C</tool_result>\n\n<tool_result>news: none</tool_result>"
        + "\n\nThanks, and?"
        + ASSISTANT
    )
    options = chat_options(tools=TOOLS)
    assert render_prompt(messages, options) == (
        BOS
        + "Be brief.\n\n"
        + TOOLS_SECTION
        + USER
        + "Weather and news?"
        + ASSISTANT
        + END_THINK
        + expected_turn
        + END_THINK
    )
    # Thinking mode with tools keeps every turn's reasoning, and each answered turn opens with <think>.
    thinking = chat_options(thinking=True, tools=TOOLS)
    assert render_prompt(messages, thinking) == (
        BOS
        + "Be brief.\n\n"
        + TOOLS_SECTION
        + USER
        + "Weather and news?"
        + ASSISTANT
        + THINK
        + "Two lookups."
        + END_THINK
        + expected_turn
        + THINK
    )
    # tool_choice "none": no tools section, the history still renders.
    assert TOOLS_SECTION not in render_prompt(messages, chat_options(tools=TOOLS, tool_choice="none"))


def test_tools_without_a_system_turn_get_an_empty_one():
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(messages, chat_options(tools=TOOLS)) == (
        BOS + "\n\n" + TOOLS_SECTION + USER + "hi" + ASSISTANT + END_THINK
    )
    developer = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "hi"}]
    assert render_prompt(developer, chat_options(tools=TOOLS)) == (
        BOS + USER + "Rules.\n\n" + TOOLS_SECTION + USER + "hi" + ASSISTANT + END_THINK
    )


def test_a_latest_reminder_turn_renders_as_the_release_renders_it():
    """The release's reminder role: its token and text; the user turn before it gets the assistant's opening (as
    before an assistant turn), and nothing follows the reminder when it is last: the model goes on from it."""
    reminder = "<｜latest_reminder｜>"
    last = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "latest_reminder", "content": "Be brief."},
    ]
    assert render_prompt(last) == BOS + "S" + USER + "a" + ASSISTANT + END_THINK + reminder + "Be brief."
    assert render_prompt(last, chat_options(thinking=True)) == (
        BOS + "S" + USER + "a" + ASSISTANT + THINK + reminder + "Be brief."
    )
    middle = [
        {"role": "user", "content": "a"},
        {"role": "latest_reminder", "content": "r"},
        {"role": "assistant", "content": "b", "reasoning_content": "old"},
        {"role": "user", "content": "c"},
    ]
    assert render_prompt(middle, chat_options(thinking=True)) == (
        BOS + USER + "a" + ASSISTANT + END_THINK + reminder + "r" + "b" + EOS + USER + "c" + ASSISTANT + THINK
    )


def test_a_tokenizer_without_the_reminder_token_refuses_the_role_and_one_with_it_encodes_it(tmp_path):
    folder = default_checkpoint_path()
    messages = [{"role": "user", "content": "a"}, {"role": "latest_reminder", "content": "Be brief."}]
    with pytest.raises(ChatTemplateError) as refused:
        load_tokenizer(folder).apply_chat_template(messages)
    assert refused.value.field == "messages"
    assert str(refused.value) == (
        "messages[1]: role 'latest_reminder' needs the <｜latest_reminder｜> token, which this model's tokenizer "
        "does not have"
    )
    spec = json.loads((folder / "tokenizer.json").read_text())
    reminder_id = len(spec["model"]["vocab"])
    spec["added_tokens"].append({**spec["added_tokens"][-1], "id": reminder_id, "content": "<｜latest_reminder｜>"})
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    for name in ("tokenizer_config.json", "config.json", "generation_config.json"):
        if (folder / name).exists():
            (tmp_path / name).write_text((folder / name).read_text())
    ids = load_tokenizer(tmp_path).apply_chat_template(messages)
    assert ids.count(reminder_id) == 1 and ids[ids.index(reminder_id) - 1] == spec["added_tokens"][6]["id"]


def test_thinking_without_tools_drops_old_reasoning_and_old_developer_turns():
    messages = [
        {"role": "developer", "content": "Old rules."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "r1"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", "reasoning_content": "r2"},
    ]
    assert render_prompt(messages, chat_options(thinking=True)) == (
        BOS
        + USER
        + "a"
        + ASSISTANT
        + END_THINK
        + "b"
        + EOS
        + USER
        + "c"
        + ASSISTANT
        + THINK
        + "r2"
        + END_THINK
        + "d"
        + EOS
    )
    # Chat mode keeps developer turns and never renders reasoning.
    assert render_prompt(messages) == (
        BOS
        + USER
        + "Old rules."
        + USER
        + "a"
        + ASSISTANT
        + END_THINK
        + "b"
        + EOS
        + USER
        + "c"
        + ASSISTANT
        + END_THINK
        + "d"
        + EOS
    )


def test_reasoning_effort_max_puts_the_release_preamble_after_bos():
    messages = [{"role": "user", "content": "q"}]
    preamble = (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your "
        "thinking and comprehensively decompose the problem to resolve the root cause, rigorously "
        "stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step, "
        "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
        "unchecked.\n\n"
    )
    assert render_prompt(messages, chat_options(thinking=True, reasoning_effort="max")) == (
        BOS + preamble + USER + "q" + ASSISTANT + THINK
    )
    plain = BOS + USER + "q" + ASSISTANT + THINK
    assert render_prompt(messages, chat_options(thinking=True, reasoning_effort="high")) == plain
    assert render_prompt(messages, chat_options(thinking=False, reasoning_effort="max")) == plain.replace(
        THINK, END_THINK
    )
    # The levels OpenAI and vLLM clients send, on DeepSeek-V4's two; "none" turns thinking off.
    for effort, rendered in [("minimal", plain), ("low", plain), ("medium", plain), ("xhigh", None)]:
        expected = rendered or BOS + preamble + USER + "q" + ASSISTANT + THINK
        assert render_prompt(messages, chat_options(thinking=True, reasoning_effort=effort)) == expected, effort
    off = chat_options(thinking=True, reasoning_effort="none")
    assert not off.thinking and render_prompt(messages, off) == plain.replace(THINK, END_THINK)


def test_the_generation_prompt_can_be_left_out_and_the_last_assistant_message_continued():
    question = [{"role": "user", "content": "q"}]
    assert render_prompt(question, chat_options(add_generation_prompt=False)) == BOS + USER + "q"
    started = question + [{"role": "assistant", "content": "Once", "reasoning_content": "r"}]
    options = chat_options(add_generation_prompt=False, continue_final_message=True)
    assert render_prompt(started, options) == BOS + USER + "q" + ASSISTANT + END_THINK + "Once"
    options = chat_options(thinking=True, add_generation_prompt=False, continue_final_message=True)
    assert render_prompt(started, options) == BOS + USER + "q" + ASSISTANT + THINK + "r" + END_THINK + "Once"
    assert parse_output(" upon", options).content == " upon"  # its reasoning is closed: the model answers on
    with pytest.raises(ChatTemplateError, match="must be the assistant's"):
        render_prompt(question, options)
    with pytest.raises(ChatTemplateError, match="Cannot set both"):
        chat_options(continue_final_message=True)  # add_generation_prompt is true unless turned off


def test_a_forced_tool_choice_starts_the_answer_with_the_call():
    messages = [{"role": "user", "content": "hi"}]
    base = BOS + "\n\n" + TOOLS_SECTION + USER + "hi" + ASSISTANT + END_THINK
    named = chat_options(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}})
    assert render_prompt(messages, named) == base + '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="search">\n'
    assert render_prompt(messages, chat_options(tools=TOOLS, tool_choice="required")) == (
        base + "\n\n<｜DSML｜tool_calls>\n"
    )


@pytest.mark.parametrize(
    "kwargs, field, text",
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "none, minimal, low, medium, high, xhigh, max"),
        ({"reasoning_effort": ["high"]}, "reasoning_effort", "must be one of"),
        ({"tools": {"name": "x"}}, "tools", "must be a list"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]}, "tools", "parameters"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "defined twice"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
        ({"tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice", "`tools` must be set"),
        ({"tools": [], "tool_choice": "none"}, "tools", "empty array"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ],
)
def test_bad_options_name_the_field(kwargs, field, text):
    with pytest.raises(ChatTemplateError) as error:
        chat_options(**kwargs)
    assert error.value.field == field and text in str(error.value)


@pytest.mark.parametrize(
    "message, text",
    [
        ({"role": "wizard"}, "messages[0]: role 'wizard'"),
        ({"role": "user", "content": [{"type": "image_url"}]}, "messages[0].content[0]: image content"),
        ({"role": "user", "content": [{"type": "audio"}]}, "messages[0].content[0]: only text"),
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "developer", "content": ""}, "messages[0].content: a developer message"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            "messages[0].tool_calls[0].function.arguments: must be a JSON object",
        ),
        ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "tool_calls[0].function.name"),
        ({"role": "assistant", "reasoning_content": 5}, "messages[0].reasoning_content"),
    ],
)
def test_bad_messages_name_the_message(message, text):
    with pytest.raises(ChatTemplateError) as error:
        render_prompt([message, {"role": "user", "content": "hi"}])
    assert error.value.field == "messages" and text in str(error.value)


def test_past_arguments_that_are_not_json_render_as_one_string_parameter():
    call = {"function": {"name": "run", "arguments": "ls -la"}}
    prompt = render_prompt(
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "", "content": "ok"},
        ]
    )
    assert (
        '<｜DSML｜invoke name="run">\n<｜DSML｜parameter name="arguments" string="true">ls -la'
        "</｜DSML｜parameter>\n</｜DSML｜invoke>"
    ) in prompt


# ---- parsing -------------------------------------------------------------------------------------------------------


def _calls(parsed: ParsedDelta) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls()]


THINKING_TOOLS = chat_options(thinking=True, tools=TOOLS)
AUTO_TOOLS = chat_options(tools=TOOLS)  # a grammar holds the calls (tool_grammar): they stream as written
# The request's own structured output constrains the answer: no grammar holds the calls, a block is parsed whole.
UNHELD_TOOLS = dataclasses.replace(AUTO_TOOLS, tool_grammar_off=True)
OUTPUTS = [  # (options, model output, reasoning, content, calls)
    (AUTO_TOOLS, "Let me look.\n\n" + CALLS_DSML, "", "Let me look.", CALLS),
    (AUTO_TOOLS, CALLS_DSML, "", "", CALLS),
    (THINKING_TOOLS, "Two cities… 🤔</think>On it.\n\n" + CALLS_DSML, "Two cities… 🤔", "On it.", CALLS),
    (THINKING_TOOLS, "no end tag, straight to tools\n\n" + CALLS_DSML, "no end tag, straight to tools", "", CALLS),
    (THINKING_TOOLS, "<think>repeated open</think>Answer: 4.", "repeated open", "Answer: 4.", []),
    (
        chat_options(thinking=True),
        "still thinking when the tokens ran out",
        "still thinking when the tokens ran out",
        "",
        [],
    ),
    (
        ChatOptions(),
        "Plain answer with <b>tags</b> and \n\n newlines.\n\n",
        "",
        "Plain answer with <b>tags</b> and \n\n newlines.\n\n",
        [],
    ),
    # Without tools, DSML is not parsed: it is text like any other.
    (ChatOptions(), "x\n\n" + CALLS_DSML, "", "x\n\n" + CALLS_DSML, []),
    (AUTO_TOOLS, "a\n\n" + CALLS_DSML + "\ntrailing", "", "a\ntrailing", CALLS),
    (UNHELD_TOOLS, "Let me look.\n\n" + CALLS_DSML, "", "Let me look.", CALLS),
    (UNHELD_TOOLS, "a\n\n" + CALLS_DSML + "\ntrailing", "", "a\ntrailing", CALLS),
    # Stray think tags in an answer are dropped, as they were when special tokens were skipped.
    (ChatOptions(), "a</think>b<think>c<thin", "", "abc<thin", []),
    (chat_options(thinking=True), "r</think>a</think>b", "r", "ab", []),
]


@pytest.mark.parametrize("options, text, reasoning, content, calls", OUTPUTS)
def test_whole_outputs_parse_into_reasoning_content_and_calls(options, text, reasoning, content, calls):
    parsed = parse_output(text, options)
    assert (parsed.reasoning, parsed.content, _calls(parsed)) == (reasoning, content, calls)
    assert all(call.id.startswith("call_") for call in parsed.calls())
    assert len({call.id for call in parsed.calls()}) == len(calls)


MALFORMED = [
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
    "Paris</｜DSML｜parameter>\n",  # the output ends inside the block
    "<｜DSML｜tool_calls>\nnot an invoke\n</｜DSML｜tool_calls>",
    "<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>",  # no call at all
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="maybe">1'
    "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">1'
    '</｜DSML｜parameter>\n<｜DSML｜parameter name="a" string="true">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>",  # a parameter twice
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜tool_calls>',  # invoke never closed
]


@pytest.mark.parametrize("block", MALFORMED)
def test_malformed_tool_calls_come_back_verbatim_as_content(block):
    text = "Before.\n\n" + block
    parsed = parse_output(text, UNHELD_TOOLS)
    assert (parsed.content, parsed.tool_calls, parsed.reasoning) == (text, [], "")


def test_values_marked_non_string_that_are_not_json_stay_strings():
    text = (
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="path" string="false">'
        '/tmp/a b</｜DSML｜parameter>\n<｜DSML｜parameter name="n" string="false"> 2.5 </｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n<｜DSML｜invoke name="g">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    assert _calls(parse_output(text, AUTO_TOOLS)) == [("f", {"path": "/tmp/a b", "n": 2.5}), ("g", {})]


def test_a_forced_call_is_read_on_from_the_prompt():
    named = chat_options(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    rest = (
        '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>"
    )
    parsed = parse_output(rest, named)
    assert (parsed.content, _calls(parsed)) == ("", [("get_weather", {"city": "Oslo"})])
    required = chat_options(tools=TOOLS, tool_choice="required")
    assert _calls(parse_output('<｜DSML｜invoke name="search">\n' + rest.replace("city", "query"), required)) == [
        ("search", {"query": "Oslo"})
    ]


# ---- streaming: any split adds up to the whole -----------------------------------------------------------------------


def _stream(pieces, options) -> tuple[ParsedDelta, list[ParsedDelta]]:
    parser = ChatOutputParser(options)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    total = ParsedDelta()
    for delta in deltas:
        total.extend(delta)
    return total, deltas


def _same(a: ParsedDelta, b: ParsedDelta) -> bool:
    def whole(parsed: ParsedDelta) -> tuple:
        return parsed.reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.calls()]

    return whole(a) == whole(b)


def _utf8_pieces(text: str, cuts: list[int]) -> list[str]:
    """The text cut at byte offsets, each piece decoded as a detokenizer would emit it (whole characters only)."""
    raw, decoder = text.encode(), codecs.getincrementaldecoder("utf-8")()
    bounds = [0, *cuts, len(raw)]
    return [decoder.decode(raw[a:b]) for a, b in zip(bounds, bounds[1:])]


REQUIRED = chat_options(tools=TOOLS, tool_choice="required")  # the grammar holds the calls: they stream as written
THINKING_REQUIRED = chat_options(thinking=True, tools=TOOLS, tool_choice="required")
# What the model writes after a forced call's answer prefix (the block's opening, in the prompt).
REQUIRED_OUTPUT = CALLS_DSML.removeprefix("<｜DSML｜tool_calls>\n")
HELD = [
    (REQUIRED, REQUIRED_OUTPUT),
    (AUTO_TOOLS, "Let me look.\n\n" + CALLS_DSML.split("line <two>")[0]),  # under auto, cut short
    (THINKING_REQUIRED, "Two cities.</think>\n\n" + CALLS_DSML),
    (REQUIRED, REQUIRED_OUTPUT.split("line <two>")[0]),  # the output ends inside a string value
    (REQUIRED, REQUIRED_OUTPUT.split("safe")[0]),  # inside a JSON value
]
STREAMED = [(o, t) for o, t, *_ in OUTPUTS] + [(UNHELD_TOOLS, "Before.\n\n" + b) for b in MALFORMED] + HELD


@pytest.mark.parametrize("options, text", STREAMED)
def test_every_byte_split_streams_to_the_whole_parse(options, text):
    whole = parse_output(text, options)
    size = len(text.encode())
    for cut in range(size + 1):
        total, _ = _stream(_utf8_pieces(text, [cut]), options)
        assert _same(total, whole), f"split at byte {cut}"
    one_by_one, deltas = _stream(_utf8_pieces(text, list(range(1, size))), options)
    assert _same(one_by_one, whole)
    rng = random.Random(size)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, size), k=min(size - 1, rng.randint(2, 8))))
        assert _same(_stream(_utf8_pieces(text, cuts), options)[0], whole), f"cuts {cuts}"
    if whole.calls():  # well-formed calls: no markup in any streamed piece
        assert not any("｜DSML｜" in d.content + d.reasoning or END_THINK in d.content + d.reasoning for d in deltas)


def test_streaming_through_the_tokenizer_token_by_token():
    tokenizer = load_tokenizer(default_checkpoint_path())
    text = "Hmm… 🤔</think>Sure.\n\n" + CALLS_DSML
    ids = tokenizer.encode(text, add_special_tokens=False) + list(tokenizer.eos_ids[:1])
    detokenizer = tokenizer.detokenizer(keep_markup=True)
    total, deltas = _stream([detokenizer.step(i) for i in ids] + [detokenizer.flush()], THINKING_TOOLS)
    assert (total.reasoning, total.content, _calls(total)) == ("Hmm… 🤔", "Sure.", CALLS)
    # Without keep_markup the </think> special token vanishes from the text, which is why chat keeps it.
    assert END_THINK not in tokenizer.decode(ids)


@pytest.mark.parametrize("options, output", HELD[:1] + HELD[2:3] + [(AUTO_TOOLS, "\n\n" + CALLS_DSML)])
def test_held_calls_parse_as_the_whole_block_parses_the_same_calls(options, output):
    """The streamed form of a grammar-held block and the whole-block form of the same calls agree to the byte."""
    held = parse_output(output, options)
    whole = parse_output("\n\n" + CALLS_DSML, UNHELD_TOOLS)
    assert [(c.name, c.arguments) for c in held.calls()] == [(c.name, c.arguments) for c in whole.calls()]
    assert _calls(held) == CALLS and held.content == ""
    assert held.reasoning == ("Two cities." if options.thinking else "")


def test_a_held_call_streams_its_name_first_and_its_arguments_as_they_are_written():
    parser = ChatOutputParser(REQUIRED)
    value_end = REQUIRED_OUTPUT.index("</｜DSML｜parameter>")
    name_end = REQUIRED_OUTPUT.index("\n<｜DSML｜parameter")
    # Up to the invoke's closing '>': no call yet (its name may still grow); then its id and name.
    head = parser.feed(REQUIRED_OUTPUT[: name_end - 1])
    assert head.tool_calls == []
    opened = parser.feed(REQUIRED_OUTPUT[name_end - 1 : name_end])
    (first,) = opened.tool_calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "") and first.id.startswith("call_")
    assert first.to_openai() == {
        "index": 0,
        "id": first.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    # A string value's text as it comes, before its closing tag (and long before the invoke's).
    written = parser.feed(REQUIRED_OUTPUT[name_end:value_end])
    assert "".join(p.arguments for p in written.tool_calls) == '{"city": "São Paulo 東京 \\"quoted\\" \\\\ back'
    assert all(p.id is None and p.to_openai()["function"].keys() == {"arguments"} for p in written.tool_calls)
    # A tag's first characters are held back until they turn out to be the closing tag.
    assert parser.feed("</｜DSML").tool_calls == []
    rest = parser.feed(REQUIRED_OUTPUT[value_end + len("</｜DSML") :])
    rest.extend(parser.finish())
    assert [p.index for p in rest.tool_calls if p.id is not None] == [1] and parser.num_calls == 2


def test_a_held_call_cut_short_ends_as_far_as_it_was_written_in_stream_and_whole_alike():
    parsed = parse_output(REQUIRED_OUTPUT.split("line <two>")[0], REQUIRED)
    (weather, search) = parsed.calls()
    assert json.loads(weather.arguments) == CALLS[0][1]
    assert search.arguments == '{"query": "line one\\n'  # as far as the model wrote it (finish_reason "length")
    assert parsed.content == ""


def test_a_held_call_cut_inside_a_tag_leaves_no_markup_in_the_content():
    cut = REQUIRED_OUTPUT[: REQUIRED_OUTPUT.index("</｜DSML｜invoke>") + len("</｜DSML")]
    parsed = parse_output(cut, REQUIRED)
    assert parsed.content == ""  # the cut "</｜DSML" is markup: dropped, not content
    assert parsed.calls()[0].arguments == '{"city": "São Paulo 東京 \\"quoted\\" \\\\ back", "days": 3'
