"""The grammar of an answer's tool calls: wherever the answer may call tools (ChatOptions.calls_held_by_grammar), the
DSML block the model writes is held to calls of the declared tools, their parameters those of each tool's schema,
each value matching its own schema.

- tool_choice "required" or a named function: the whole answer is the block, after the answer prefix the prompt ends
  with (ChatOptions.answer_prefix).
- "auto": the answer is free text, which may end with a block; from the block's opening tag on, the grammar holds
  it (vLLM's auto leaves the block to the model).

In thinking mode the answer comes after the reasoning (the model reasons first, as vLLM lets it): the grammar then
begins with the reasoning, any text without `</think>` or a block's opening, then the `</think>` token (under auto
the output may also end in its reasoning). A Lark
grammar in llguidance's dialect (`%json {...}` embeds a JSON schema, `<...>` names a special token).

Parameters come in the schema's order, the ones it does not require optional; a string parameter is written raw
(`string="true"`), so its grammar is the string's own (enum, pattern, length) without JSON's quotes; any other value
is JSON that matches its schema. A value's schema is embedded on its own, so the definitions the tool's schema keeps
at its root (`$defs`, or the older `definitions`: what pydantic's `model_json_schema()` writes) go with it, and its
`$ref`s (`#/$defs/...`) resolve there as they did in the whole schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jaxserve.request.grammar import JSON_OPTIONS
from jaxserve.text.chat.encoding import (
    INVOKE_CLOSE,
    PARAMETER_CLOSE,
    THINK_END,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    ChatOptions,
    invoke_open,
    parameter_open,
)


def tool_call_grammar(options: ChatOptions) -> str | None:
    """The Lark grammar of the answer when `options` hold its tool calls (None when they do not)."""
    if not options.calls_held_by_grammar:
        return None
    rules: list[str] = []
    end = f"{_literal(chr(10) + TOOL_CALLS_CLOSE)}"
    # Neither the reasoning nor an answer's text may open a block the grammar does not hold.
    unheld = f"{_regex_literal(THINK_END)}|{_regex_literal(TOOL_CALLS_OPEN)}"
    reasoning = ""
    if options.thinking and not options.continue_final_message:
        reasoning = f"REASONING {THINK_END} "
        rules.append(f"REASONING: /(?s:.*)/ & ~/(?s:.*({unheld}).*)/")
    if options.tool_choice == "function":  # the named invoke is open: its parameters come next
        function = next(f for f in options.tools if f["name"] == options.tool_name)
        opening = _literal(options.forced_opening) + " " if reasoning else ""
        rules.append(
            f"start: {reasoning}{opening}{_parameters(function, 'f', rules)} {_literal(chr(10) + INVOKE_CLOSE)} {end}"
        )
        return "\n".join(rules)
    # Each call also in a form with the newline before it in its opening literal, as parameters have (_parameters).
    for k, function in enumerate(options.tools):
        opening_line = invoke_open(function["name"]) + chr(10)
        rules.append(f"invoke_{k}_body: {_parameters(function, f'f{k}', rules)} {_literal(chr(10) + INVOKE_CLOSE)}")
        rules.append(f"invoke_{k}: {_literal(opening_line)} invoke_{k}_body")
        rules.append(f"invoke_{k}_nl: {_literal(chr(10) + opening_line)} invoke_{k}_body")
    calls = range(len(options.tools))
    rules.append(f"invoke: {' | '.join(f'invoke_{k}' for k in calls)}")
    rules.append(f"invoke_nl: {' | '.join(f'invoke_{k}_nl' for k in calls)}")
    more = " (invoke_nl)*" if options.parallel_tool_calls else ""  # parallel_tool_calls false: one call
    if options.tool_choice == "required":
        opening = _literal(options.forced_opening) + " " if reasoning else ""
        rules.append(f"start: {reasoning}{opening}invoke{more} {end}")
        return "\n".join(rules)
    # auto: text, then maybe a block. The text before a block is one lexeme with the block's opening tag at its end
    # (as a string value's closing tag is, _raw_string): a lexeme that stopped before the tag would let the lexer
    # run on into it.
    opening_tag = _regex_literal(TOOL_CALLS_OPEN)
    rules.append(f"ANSWER: /(?s:.*)/ & ~/(?s:.*{opening_tag}.*)/")
    rules.append(f"ANSWER_THEN_BLOCK: /(?s:.*){opening_tag}/ & ~/(?s:.*{opening_tag}.+)/")
    answer = f"(ANSWER | ANSWER_THEN_BLOCK invoke_nl{more} {end})"
    # An output may end in its reasoning (the parser then has reasoning alone), as it may without the grammar.
    rules.append(f"start: REASONING | {reasoning}{answer}" if reasoning else f"start: {answer}")
    return "\n".join(rules)


def _parameters(function: dict, prefix: str, rules: list[str]) -> str:
    """The grammar of one function's parameter lines (adding its rules to `rules`): in the schema's order, one line
    each, joined by newlines, the ones the schema does not require optional. Each parameter has a rule with its
    newline in front too (one literal: the lexer tells `\n<｜DSML｜parameter` from the invoke's closing `\n</...` by
    their bytes, where a separate newline lexeme would make it guess)."""
    schema = function.get("parameters") or {}
    required = set(schema.get("required", ()))
    definitions = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
    params: list[tuple[str, bool]] = []
    for k, (name, value_schema) in enumerate((schema.get("properties") or {}).items()):
        rule = f"{prefix}_p{k}"
        is_string = isinstance(value_schema, dict) and value_schema.get("type") == "string"
        if is_string:
            value = f"{rule.upper()}_VALUE"  # a lexeme (an upper-case name)
            rules.append(f"{value}: {_raw_string(value_schema)}")
        else:
            value = f"{rule}_value {_literal(PARAMETER_CLOSE)}"
            rules.append(f"{rule}_value: %json {json.dumps(_embedded(definitions, value_schema))}")
        opening = parameter_open(name, is_string)
        rules.append(f"{rule}: {_literal(opening)} {value}")
        rules.append(f"{rule}_nl: {_literal(chr(10) + opening)} {value}")
        params.append((rule, name in required))
    if not params:
        return '""'

    def after(i: int) -> str:  # the parameters from the i-th on, each on a new line
        return " ".join(f"{rule}_nl" if needed else f"({rule}_nl)?" for rule, needed in params[i:])

    # Which parameter comes first decides which has no newline before it: any up to the first required one.
    firsts = []
    for k, (rule, needed) in enumerate(params):
        firsts.append(f"{rule} {after(k + 1)}".strip())
        if needed:
            break
    else:
        firsts.append('""')  # none required: none at all
    return "(" + " | ".join(firsts) + ")"


def _embedded(definitions: dict[str, Any], schema: Any) -> dict[str, Any]:
    """A parameter's schema as the grammar embeds it: with the tool schema's root definitions, for the `$ref`s in it,
    and JSON written as DeepSeek's encoder writes a value (`json.dumps`: ", " and ": ", no other whitespace), which
    structured outputs also hold to (JSON_OPTIONS): whitespace left free lets a model pad an object until max_tokens."""
    own = schema if isinstance(schema, dict) else {}
    return {**definitions, **own, "x-guidance": JSON_OPTIONS}


def _raw_string(schema: dict[str, Any]) -> str:
    """A string parameter's raw value and the parameter's closing tag, as one lexeme: a free text may hold any
    character, '<' included, and ends at the first closing tag (a lexeme that stopped before the tag would let the
    lexer run on into it)."""
    close = _regex_literal(PARAMETER_CLOSE)
    if "enum" in schema:
        return f"/({'|'.join(_regex_literal(str(v)) for v in schema['enum'])}){close}/"
    if "pattern" in schema:
        return f"/({schema['pattern'].removeprefix('^').removesuffix('$')}){close}/"
    if "minLength" in schema or "maxLength" in schema:
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        text = f"(?s:.{{{low},{'' if high is None else int(high)}}})"
    else:
        text = "(?s:.*)"  # unbounded: a bound of thousands makes llguidance's lexeme checks run out of fuel
    return f"/{text}{close}/ & ~/(?s:.*{close}.+)/"


def _regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark /regex/ (where "/" is escaped too)."""
    return re.escape(text).replace("/", "\\/")


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
