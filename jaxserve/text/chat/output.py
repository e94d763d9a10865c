"""DeepSeek-V4's output text -> reasoning_content, content and tool calls, fed piece by piece as it streams.

The model writes `reasoning</think>` first in thinking mode, then the answer, then, to call tools,
`\\n\\n<｜DSML｜tool_calls> ... </｜DSML｜tool_calls>` (see encoding.py). The parser is one state machine for
streaming and whole outputs alike (`parse_output` feeds everything at once), so the pieces a stream delivers add up
to exactly what the whole output parses to, wherever the text was split.

- Text that may be the start of a marker (`</think>`, the tool-call block's opening, the separator before it) is
  held back until the next piece decides, so no markup ever reaches content or reasoning. Stray `<think>` or
  `</think>` tags in the answer are dropped, as skipping special tokens did before the parser saw them.
- A tool-call block is held whole until its closing tag and then checked; its calls come out together, each as
  name then arguments (a JSON object text). A block that breaks DSML's grammar, or that the output ends inside,
  comes back verbatim as content: malformed model output is the client's to see, never a server error.
- Arguments: `string="true"` values are JSON strings as written; other values are JSON, and one that does not
  parse is kept as a string (models do mark strings as string="false").
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from jaxserve.text.chat.encoding import (
    DSML,
    INVOKE_CLOSE,
    PARAMETER_CLOSE,
    THINK_END,
    THINK_START,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    TOOL_CALLS_SEPARATOR,
    ChatOptions,
    to_json,
)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    """What one piece of output added; empty strings and no calls when it added nothing visible."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


_INVOKE = re.compile(r"\s*<" + DSML + r'invoke name="([^"]+)">\s*')
_PARAMETER = re.compile(r"<" + DSML + r'parameter name="([^"]+)" string="(true|false)">')
_REASONING, _CONTENT, _BLOCK = "reasoning", "content", "block"


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers` (to hold back)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def parse_tool_block(body: str) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON) calls in the text between a block's opening and closing tags, or None when it
    is not DSML (then the caller returns the block as text)."""
    calls: list[tuple[str, str]] = []
    at = 0
    while True:
        invoke = _INVOKE.match(body, at)
        if invoke is None:
            return calls if calls and not body[at:].strip() else None
        at, params = invoke.end(), {}
        while (param := _PARAMETER.match(body, at)) is not None:
            end = body.find(PARAMETER_CLOSE, param.end())
            name = param.group(1)
            if end < 0 or name in params:
                return None
            params[name] = _argument(body[param.end() : end], param.group(2) == "true")
            at = end + len(PARAMETER_CLOSE)
            at += len(body[at:]) - len(body[at:].lstrip())
        if not body.startswith(INVOKE_CLOSE, at):
            return None
        at += len(INVOKE_CLOSE)
        calls.append((invoke.group(1), "{" + ", ".join(f"{to_json(k)}: {v}" for k, v in params.items()) + "}"))


def _argument(raw: str, is_string: bool) -> str:
    """One parameter's value as JSON text."""
    if not is_string:
        try:
            return to_json(json.loads(raw))
        except json.JSONDecodeError:
            pass
    return to_json(raw)


class ChatOutputParser:
    """One request's output: `feed(text)` for each new piece, `finish()` once at the end; each returns a
    ParsedDelta. When tool_choice forced the answer to start with a call, that start (in the prompt) is read first,
    so `feed` sees only what the model wrote."""

    def __init__(self, options: ChatOptions):
        self._tools = options.uses_tools
        self._calls_left = None if options.parallel_tool_calls else 1  # parallel_tool_calls false: the first only
        # A continued assistant message has its reasoning closed already: the model goes on with the answer.
        self._state = _REASONING if options.thinking and not options.continue_final_message else _CONTENT
        self._buffer = ""
        self._at_start = True  # a leading <think> in thinking mode is the model repeating the prompt's
        self._block_lead = ""  # the separator read before the open block, given back if the block is text
        prefix = options.answer_prefix
        if prefix:
            self._buffer = prefix[len(TOOL_CALLS_SEPARATOR) :]
            self._state = _BLOCK

    @property
    def _markers(self) -> tuple[str, ...]:
        block = (TOOL_CALLS_SEPARATOR + TOOL_CALLS_OPEN, TOOL_CALLS_OPEN) if self._tools else ()
        return (THINK_END, *block) if self._state == _REASONING else (THINK_START, THINK_END, *block)

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self._state == _BLOCK:
                end = self._buffer.find(TOOL_CALLS_CLOSE)
                if end < 0 and not final:
                    return out
                block_end = len(self._buffer) if end < 0 else end + len(TOOL_CALLS_CLOSE)
                calls = None if end < 0 else parse_tool_block(self._buffer[len(TOOL_CALLS_OPEN) : end])
                if calls is None:  # not DSML after all: the block is text
                    out.content += self._block_lead + self._buffer[:block_end]
                else:
                    if self._calls_left is not None:
                        calls, self._calls_left = calls[: self._calls_left], max(0, self._calls_left - len(calls))
                    out.tool_calls += [
                        ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments) for name, arguments in calls
                    ]
                self._buffer = self._buffer[block_end:]
                self._state = _CONTENT
                continue
            if self._state == _REASONING and self._at_start:
                if not final and THINK_START.startswith(self._buffer):
                    return out  # maybe the start of a repeated <think>
                self._buffer = self._buffer.removeprefix(THINK_START)
                self._at_start = False
            found = [(self._buffer.find(m), m) for m in self._markers if m in self._buffer]
            if found:
                at, marker = min(found, key=lambda f: (f[0], -len(f[1])))
                self._emit(out, self._buffer[:at])
                rest = self._buffer[at + len(marker) :]
                if marker in (THINK_START, THINK_END):  # ends the reasoning; in the answer, a stray tag is dropped
                    self._state, self._buffer = _CONTENT, rest
                else:
                    self._state, self._buffer = _BLOCK, TOOL_CALLS_OPEN + rest
                    self._block_lead = marker[: -len(TOOL_CALLS_OPEN)]
                continue
            keep = 0 if final else _held_suffix(self._buffer, self._markers)
            self._emit(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def _emit(self, out: ParsedDelta, text: str) -> None:
        if self._state == _REASONING:
            out.reasoning += text
        else:
            out.content += text


def parse_output(text: str, options: ChatOptions) -> ParsedDelta:
    """A whole output at once."""
    parser = ChatOutputParser(options)
    out = parser.feed(text)
    out.extend(parser.finish())
    return out
