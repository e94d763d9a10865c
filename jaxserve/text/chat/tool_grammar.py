"""The grammar of a forced tool call (tool_choice "required" or a named function): the DSML block the model writes
after the answer prefix the prompt ends with (ChatOptions.answer_prefix), its parameters those of the tool's schema,
each value matching its own schema. In thinking mode the prompt cannot start the answer (the model reasons first, as
vLLM lets it): the grammar then begins with the reasoning, any text without `</think>`, the `</think>` token and the
call's opening (ChatOptions.forced_opening). A Lark grammar in llguidance's dialect (`%json {...}` embeds a JSON
schema, `<...>` names a special token).

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

from jaxserve.text.chat.encoding import (
    INVOKE_CLOSE,
    PARAMETER_CLOSE,
    THINK_END,
    TOOL_CALLS_CLOSE,
    ChatOptions,
    invoke_open,
    parameter_open,
)

RAW_STRING_MAX = 4096  # characters of a string parameter without its own maxLength (it stops before a '<')


def forced_tool_call_grammar(options: ChatOptions) -> str | None:
    """The Lark grammar of the rest of the answer when `options` force a tool call (None when they do not)."""
    if not options.uses_tools or options.tool_choice not in ("required", "function"):
        return None
    rules: list[str] = []
    end = f"{_literal(chr(10) + TOOL_CALLS_CLOSE)}"
    # What the answer prefix did not write: in thinking mode the reasoning and the call's whole opening.
    opening = ""
    if options.thinking:
        opening = f"REASONING {THINK_END} {_literal(options.forced_opening)} "
        no_end = re.escape(THINK_END).replace("/", "\\/")  # in a Lark /regex/, "/" is escaped
        rules.append(f"REASONING: /(?s:.*)/ & ~/(?s:.*{no_end}.*)/")
    if options.tool_choice == "function":  # the named invoke is open: its parameters come next
        function = next(f for f in options.tools if f["name"] == options.tool_name)
        rules.append(f"start: {opening}{_parameters(function, 'f', rules)} {_literal(chr(10) + INVOKE_CLOSE)} {end}")
    else:
        invokes = []
        for k, function in enumerate(options.tools):
            name = f"invoke_{k}"
            body = _parameters(function, f"f{k}", rules)
            rules.append(
                f"{name}: {_literal(invoke_open(function['name']) + chr(10))} {body} {_literal(chr(10) + INVOKE_CLOSE)}"
            )
            invokes.append(name)
        rules.append(f"invoke: {' | '.join(invokes)}")
        rules.append(f'start: {opening}invoke ("\\n" invoke)* {end}')
    return "\n".join(rules)


def _parameters(function: dict, prefix: str, rules: list[str]) -> str:
    """The grammar of one function's parameter lines (adding a rule per parameter to `rules`)."""
    schema = function.get("parameters") or {}
    required = set(schema.get("required", ()))
    definitions = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
    parts = []
    for k, (name, value_schema) in enumerate((schema.get("properties") or {}).items()):
        rule = f"{prefix}_p{k}"
        is_string = isinstance(value_schema, dict) and value_schema.get("type") == "string"
        value = _raw_string(value_schema) if is_string else f"%json {json.dumps(_with(definitions, value_schema))}"
        rules.append(f"{rule}: {_literal(parameter_open(name, is_string))} {value} {_literal(PARAMETER_CLOSE)}")
        parts.append((rule, name in required))
    if not parts:
        return '""'
    # Lines joined by newlines: the first present one has none before it, so optional parameters are written in
    # order, each with its separator, after the required ones it follows.
    text = ""
    for rule, needed in parts:
        item = f'"\\n" {rule}' if text else rule
        text = f"{text} {item}" if needed else f"{text} ({item})?"
    return text.strip()


def _with(definitions: dict[str, Any], schema: Any) -> Any:
    """A parameter's schema carrying the tool schema's root definitions, for the `$ref`s in it."""
    if not definitions or not isinstance(schema, dict):
        return schema or {}
    return {**definitions, **schema}


def _raw_string(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return "(" + " | ".join(_literal(str(v)) for v in schema["enum"]) + ")"
    if "pattern" in schema:
        return f"/{schema['pattern'].removeprefix('^').removesuffix('$')}/"
    low, high = int(schema.get("minLength", 0)), int(schema.get("maxLength", RAW_STRING_MAX))
    return f"/[^<]{{{low},{high}}}/"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
