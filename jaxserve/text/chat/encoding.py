"""DeepSeek-V4's chat encoding: OpenAI-style messages and tools -> the prompt text, as the release's own encoder
(`encoding_dsv4.py`, `encode_messages` with its defaults) renders it.

- The prompt is BOS, then each message: system text (with the tools section appended), `<｜User｜>` user text,
  assistant turns as `[reasoning</think>]content[\\n\\n<DSML tool_calls block>]` + EOS. A user or developer turn
  that the assistant answers next is followed by `<｜Assistant｜>` and `<think>` (thinking mode) or `</think>`.
- A `latest_reminder` message (the release's role) renders as `<｜latest_reminder｜>` and its text; a user turn
  before it gets the assistant's opening first, as before an assistant turn.
- `tool` messages are not a role of their own: consecutive tool results (and a user message right after them)
  merge into one user turn of `<tool_result>...</tool_result>` blocks, in the order of the calls that asked for them.
- Thinking mode drops the reasoning of turns before the last user turn, and developer turns before it, unless
  the request has tools: then every turn keeps its reasoning.
- `reasoning_effort="max"` (thinking mode only) puts the release's "Reasoning Effort" preamble right after BOS;
  "high" renders nothing extra. Clients' other levels map onto these (REASONING_EFFORTS): "none" turns thinking
  off, "minimal" to "medium" are "high", "xhigh" is "max".
- `tool_choice` "required" or a named function cannot be enforced by sampling, so the answer is started for the
  model: the prompt ends with the opening of the tool-call block (and of the named invoke), which the output
  parser reads as already generated.

Everything a client can get wrong raises ChatTemplateError naming the request field, so the server answers 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
CHAT_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, THINK_START, THINK_END)
# The release's reminder turn: its token, then its text, right where the model goes on (a turn answered by the
# assistant or followed by a reminder gets the assistant's opening first). Not every tokenizer has the token.
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"

DSML = "｜DSML｜"
TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAMETER_CLOSE = f"</{DSML}parameter>"
TOOL_CALLS_SEPARATOR = "\n\n"  # between an assistant turn's content and its tool-call block


def invoke_open(name: str) -> str:
    return f'<{DSML}invoke name="{name}">'


def parameter_open(name: str, is_string: bool) -> str:
    return f'<{DSML}parameter name="{name}" string="{"true" if is_string else "false"}">'


# The levels clients send (OpenAI's and vLLM's) onto DeepSeek-V4's two: "none" turns thinking off; up to "high"
# is the release's "high" (it renders nothing extra); "xhigh" and "max" are its "max" (the preamble below).
REASONING_EFFORTS = {
    "none": None,
    "minimal": "high",
    "low": "high",
    "medium": "high",
    "high": "high",
    "xhigh": "max",
    "max": "max",
}
REASONING_EFFORT_MAX_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

# The release's tools section, word for word: the model was trained on exactly this text.
TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{TOOL_CALLS_OPEN}" block like the following:

{TOOL_CALLS_OPEN}
{invoke_open("$TOOL_NAME")}
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_CLOSE}
...
{INVOKE_CLOSE}
{invoke_open("$TOOL_NAME2")}
...
{INVOKE_CLOSE}
{TOOL_CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{tool_schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501 - the release's lines, unwrapped

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")  # the release's encoder's


class ChatTemplateError(ValueError):
    """A request the chat encoding cannot render; `field` is the request field at fault (for the 400's param)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---- request options ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatOptions:
    """How a request is rendered and its output parsed: thinking mode, reasoning effort, tools and tool_choice."""

    thinking: bool = False
    reasoning_effort: str | None = None  # DeepSeek-V4's level: "high" | "max" | None
    tools: tuple[dict, ...] = ()  # the tools' "function" objects, as the client sent them
    tool_choice: str = "auto"  # "auto" | "none" | "required" | "function"
    tool_name: str | None = None  # the function tool_choice names
    add_generation_prompt: bool = True  # vLLM's: a last user turn is followed by the assistant's opening
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is left open for the model to go on
    parallel_tool_calls: bool = True  # OpenAI's: false, an answer calls one tool at most (the first call it writes)
    # No grammar holds the calls under auto: the request's own structured output constrains the answer instead, or
    # the engine takes no constraints (speculative decoding, a tokenizer without a grammar compiler).
    tool_grammar_off: bool = False

    @property
    def uses_tools(self) -> bool:
        """Tools are rendered into the prompt and tool calls parsed out of the output."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_call(self) -> bool:
        """tool_choice "required" or a named function: the answer is a tool call."""
        return self.uses_tools and self.tool_choice in ("required", "function")

    @property
    def calls_held_by_grammar(self) -> bool:
        """A grammar holds the answer's tool calls to the tools and their schemas (tool_grammar), so the output parser
        may stream them as they are written: a forced call, or under auto unless tool_grammar_off."""
        return self.forces_call or (self.uses_tools and not self.tool_grammar_off)

    @property
    def forced_opening(self) -> str:
        """How the answer's tool-call block opens when tool_choice forces a call (with the named function's invoke
        opened too); "" when it does not."""
        if not self.forces_call:
            return ""
        prefix = TOOL_CALLS_SEPARATOR + TOOL_CALLS_OPEN + "\n"
        if self.tool_choice != "function":
            return prefix
        assert self.tool_name is not None  # chat_options names the function whenever tool_choice is "function"
        return prefix + invoke_open(self.tool_name) + "\n"

    @property
    def answer_prefix(self) -> str:
        """The start of the answer written for the model: a forced call's opening, unless thinking mode must first
        reason (the call's grammar then holds the reasoning, `</think>` and the opening: tool_grammar)."""
        return "" if self.thinking else self.forced_opening


def chat_options(
    thinking: bool = False,
    reasoning_effort: Any = None,
    tools: Any = None,
    tool_choice: Any = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    parallel_tool_calls: bool = True,
) -> ChatOptions:
    """Validated options from the request's raw `tools`, `tool_choice` and reasoning settings."""
    if reasoning_effort is not None and (
        not isinstance(reasoning_effort, str) or reasoning_effort not in REASONING_EFFORTS
    ):
        raise ChatTemplateError(
            "reasoning_effort",
            f"reasoning_effort: must be one of {', '.join(REASONING_EFFORTS)} "
            f"(none: no thinking; up to high: DeepSeek-V4's high; xhigh and max: its max), got {reasoning_effort!r}",
        )
    if reasoning_effort is not None:
        thinking = thinking and reasoning_effort != "none"
        reasoning_effort = REASONING_EFFORTS[reasoning_effort]
    functions = _tools(tools)
    if tools is None and tool_choice not in (None, "none"):  # vLLM's check_tool_usage, the same message
        raise ChatTemplateError("tool_choice", "tool_choice: When using `tool_choice`, `tools` must be set.")
    choice, name = _tool_choice(tool_choice, functions)
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message", "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    if continue_final_message and choice in ("required", "function") and functions:
        raise ChatTemplateError(
            "continue_final_message",
            "continue_final_message: a forced tool_choice starts a new answer, so it cannot continue the last one",
        )
    return ChatOptions(
        bool(thinking),
        reasoning_effort,
        functions,
        choice,
        name,
        add_generation_prompt,
        continue_final_message,
        parallel_tool_calls,
    )


def _tools(tools: Any) -> tuple[dict, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ChatTemplateError("tools", f"tools: must be a list of tools, got {type(tools).__name__}")
    if not tools:  # as OpenAI and vLLM
        raise ChatTemplateError(
            "tools", "tools: must not be an empty array; provide at least one tool or leave the field out"
        )
    functions, names = [], set()
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ChatTemplateError("tools", f'{where}: must be {{"type": "function", "function": {{...}}}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ChatTemplateError("tools", f"{where}.function: must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name or '"' in name:
            raise ChatTemplateError(
                "tools", f"{where}.function.name: must be a non-empty string without '\"', got {name!r}"
            )
        if name in names:
            raise ChatTemplateError("tools", f"{where}.function.name: {name!r} is defined twice")
        if not isinstance(function.get("description", ""), str):
            raise ChatTemplateError("tools", f"{where}.function.description: must be a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise ChatTemplateError("tools", f"{where}.function.parameters: must be a JSON Schema object")
        names.add(name)
        functions.append(function)
    return tuple(functions)


def _tool_choice(choice: Any, functions: tuple[dict, ...]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("auto", "none", "required"):
        return choice, None
    named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(name, str):
        raise ChatTemplateError(
            "tool_choice",
            "tool_choice: must be 'auto', 'none', 'required' or "
            f'{{"type": "function", "function": {{"name": ...}}}}, '
            f"got {choice!r}",
        )
    if name not in {f["name"] for f in functions}:
        raise ChatTemplateError("tool_choice", f"tool_choice.function.name: {name!r} is not one of the tools")
    return "function", name


# ---- messages -------------------------------------------------------------------------------------------------------


@dataclass
class _Turn:
    """One message, validated: what rendering needs of it."""

    role: str
    text: str = ""  # system/developer/assistant content; user text is in `blocks`
    blocks: list[tuple[str, str, str]] = field(default_factory=list)  # user turns: (kind, text, tool_call_id)
    reasoning: str = ""
    tool_calls: list[tuple[str, dict, str]] | None = None  # (name, arguments, id)
    tools: tuple[dict, ...] = ()


def _text(content: Any, where: str, joiner: str = "") -> str:
    """OpenAI message content: a string, null, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and "image" in kind:  # image_url, input_image, image
                    raise ChatTemplateError(
                        "messages",
                        f"{where}.content[{k}]: image content ({kind!r}) is not supported: jaxserve serves the text "
                        "model only (DeepSeek-V4.1's vision tower is not built)",
                    )
                raise ChatTemplateError(
                    "messages", f"{where}.content[{k}]: only text parts are supported, got {part!r:.80}"
                )
            parts.append(part["text"])
        return joiner.join(parts)
    raise ChatTemplateError(
        "messages", f"{where}.content: must be a string or a list of text parts, got {type(content).__name__}"
    )


def _arguments(raw: Any, where: str) -> dict:
    """A past call's arguments as the release reads them: a JSON object; text that is not JSON at all is kept
    whole as one "arguments" string parameter."""
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise ChatTemplateError("messages", f"{where}: must be a JSON object or its text, got {type(raw).__name__}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return {"arguments": raw}
    if not isinstance(value, dict):
        raise ChatTemplateError("messages", f"{where}: must be a JSON object, got {raw!r:.80}")
    return value


def _tool_calls(calls: Any, where: str) -> list[tuple[str, dict, str]]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ChatTemplateError("messages", f"{where}: must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        here = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ChatTemplateError("messages", f"{here}.function: must be an object with name and arguments")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ChatTemplateError("messages", f"{here}.function.name: must be a non-empty string")
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise ChatTemplateError("messages", f"{here}.id: must be a string")
        out.append((name, _arguments(function.get("arguments", "{}"), f"{here}.function.arguments"), call_id))
    return out


def _turn(message: Any, k: int) -> _Turn:
    where = f"messages[{k}]"
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ROLES:
        raise ChatTemplateError(
            "messages", f"{where}: role {role!r} is not one of DeepSeek-V4's chat roles ({', '.join(ROLES)})"
        )
    content = message.get("content")
    if role == "user":
        return _Turn(role, blocks=[("text", _text(content, where), "")])
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ChatTemplateError("messages", f"{where}.tool_call_id: must be a string")
        return _Turn("user", blocks=[("tool_result", _text(content, where, joiner="\n\n"), call_id)])
    if role == "assistant":
        name = "reasoning_content" if message.get("reasoning_content") is not None else "reasoning"  # vLLM's newer
        reasoning = message.get(name)
        if reasoning is not None and not isinstance(reasoning, str):
            raise ChatTemplateError("messages", f"{where}.{name}: must be a string")
        return _Turn(
            role,
            _text(content, where),
            reasoning=reasoning or "",
            tool_calls=_tool_calls(message.get("tool_calls"), f"{where}.tool_calls"),
        )
    text = _text(content, where)
    if role == "developer" and not text:
        raise ChatTemplateError("messages", f"{where}.content: a developer message must not be empty")
    return _Turn(role, text)


def _merge_user_turns(turns: list[_Turn]) -> list[_Turn]:
    """Consecutive user turns (tool results included) become one, as the release merges tool messages."""
    merged: list[_Turn] = []
    for turn in turns:
        if turn.role == "user" and merged and merged[-1].role == "user":
            merged[-1].blocks.extend(turn.blocks)
        else:
            merged.append(turn)
    return merged


def _order_tool_results(turns: list[_Turn]) -> None:
    """Tool results in a user turn follow the order of the latest assistant turn's calls; other blocks stay put."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            order = {call_id: j for j, (_, _, call_id) in enumerate(turn.tool_calls) if call_id}
        elif turn.role == "user" and order:
            results = [b for b in turn.blocks if b[0] == "tool_result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b[2], 0)))
                turn.blocks = [next(ranked) if b[0] == "tool_result" else b for b in turn.blocks]


def render_tool_calls(calls: list[tuple[str, dict]]) -> str:
    """An assistant turn's DSML block (without the separator before it)."""
    invokes = []
    for name, arguments in calls:
        params = [
            parameter_open(key, isinstance(value, str))
            + (value if isinstance(value, str) else to_json(value))
            + PARAMETER_CLOSE
            for key, value in arguments.items()
        ]
        invokes.append(invoke_open(name) + "\n" + "\n".join(params) + "\n" + INVOKE_CLOSE)
    return TOOL_CALLS_OPEN + "\n" + "\n".join(invokes) + "\n" + TOOL_CALLS_CLOSE


def _render_user(turn: _Turn) -> str:
    return USER_TOKEN + "\n\n".join(
        text if kind == "text" else f"<tool_result>{text}</tool_result>" for kind, text, _ in turn.blocks
    )


def _last_user(turns: list[_Turn]) -> int:
    return max((k for k, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def render_prompt(messages: Any, options: ChatOptions = ChatOptions()) -> str:
    """The prompt text for `messages` (OpenAI chat messages) under `options`, ending with the generation prompt
    (or, with continue_final_message, the last assistant message left open: its reasoning closed, its text not)."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages", "messages: at least one message is needed")
    turns = [_turn(message, k) for k, message in enumerate(messages)]
    if options.continue_final_message and turns[-1].role != "assistant":
        raise ChatTemplateError(
            "messages", "messages: continue_final_message continues the last message, which must be the assistant's"
        )
    if options.uses_tools:  # request tools join the leading system/developer turn, or a new empty system turn
        if turns[0].role not in ("system", "developer"):
            turns.insert(0, _Turn("system"))
        turns[0].tools = options.tools
    turns = _merge_user_turns(turns)
    _order_tool_results(turns)
    keep_reasoning = options.uses_tools
    if options.thinking and not keep_reasoning:  # developer turns before the last user turn are dropped
        cut = _last_user(turns)
        turns = [t for k, t in enumerate(turns) if k >= cut or t.role != "developer"]
    last_user = _last_user(turns)

    out = [BOS_TOKEN]
    if options.thinking and options.reasoning_effort == "max":
        out.append(REASONING_EFFORT_MAX_PREAMBLE)
    for k, turn in enumerate(turns):
        tools = "\n\n" + TOOLS_SECTION.format(tool_schemas="\n".join(map(to_json, turn.tools))) if turn.tools else ""
        if turn.role == "system":
            out.append(turn.text + tools)
        elif turn.role == "developer":
            out.append(USER_TOKEN + turn.text + tools)
        elif turn.role == "user":
            out.append(_render_user(turn))
        elif turn.role == "latest_reminder":
            out.append(LATEST_REMINDER_TOKEN + turn.text)
        else:
            reasoning = turn.reasoning + THINK_END if options.thinking and (keep_reasoning or k > last_user) else ""
            calls = (
                TOOL_CALLS_SEPARATOR + render_tool_calls([(n, a) for n, a, _ in turn.tool_calls])
                if turn.tool_calls
                else ""
            )
            left_open = options.continue_final_message and k + 1 == len(turns)  # the model goes on from its end
            out.append(reasoning + turn.text + calls + ("" if left_open else EOS_TOKEN))
        last = k + 1 == len(turns)
        answered = options.add_generation_prompt if last else turns[k + 1].role in ("assistant", "latest_reminder")
        if turn.role in ("user", "developer") and answered:
            opens_thinking = options.thinking and (keep_reasoning or k >= last_user)
            out.append(ASSISTANT_TOKEN + (THINK_START if opens_thinking else THINK_END))
    out.append(options.answer_prefix)
    return "".join(out)
