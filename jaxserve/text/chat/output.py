"""DeepSeek-V4's output text -> reasoning_content, content and tool calls, fed piece by piece as it streams.

The model writes `reasoning</think>` first in thinking mode, then the answer, then, to call tools,
`\\n\\n<｜DSML｜tool_calls> ... </｜DSML｜tool_calls>` (see encoding.py). The parser is one state machine for
streaming and whole outputs alike (`parse_output` feeds everything at once), so the pieces a stream delivers add up
to exactly what the whole output parses to, wherever the text was split.

- Text that may be the start of a marker (`</think>`, the tool-call block's opening, the separator before it) is
  held back until the next piece decides, so no markup ever reaches content or reasoning. Stray `<think>` or
  `</think>` tags in the answer are dropped, as skipping special tokens did before the parser saw them.
- Tool calls come out as OpenAI streams them: a call's first delta carries its index, id and name, the next ones
  fragments of its `arguments` (a JSON object's text once joined). Where a grammar holds the block to the tools'
  calls (`ChatOptions.calls_held_by_grammar`: whenever tools may be called, unless the request's own structured
  output constrains the answer instead), the block cannot turn out malformed, so each call is streamed as the model
  writes it: the name once its invoke tag is complete, a string parameter's text as it comes (only what may be the
  start of its closing tag held back), any other value once its closing tag is read; a call cut short (max_tokens)
  ends as far as it was written.
  Elsewhere the block is held whole until its closing tag and then checked, so that a block that breaks DSML's
  grammar, or that the output ends inside, comes back verbatim as content, never half a call in `tool_calls`:
  malformed model output is the client's to see, never a server error.
- Arguments: `string="true"` values are JSON strings as written; other values are JSON, and one that does not
  parse is kept as a string (models do mark strings as string="false").
"""

from __future__ import annotations

import dataclasses
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


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the answer's `index`-th call: its first piece has the call's id and name, the others neither."""

    index: int
    arguments: str = ""  # the next fragment of the call's arguments
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        """As OpenAI streams a call: index, id, type and name first; then index and arguments fragments."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class ParsedDelta:
    """What one piece of output added; empty strings and no call pieces when it added nothing visible."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        for piece in other.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == piece.index and piece.id is None:  # one piece per call
                piece = dataclasses.replace(last, arguments=last.arguments + piece.arguments)
                self.tool_calls.pop()
            self.tool_calls.append(piece)

    def calls(self) -> list[ToolCall]:
        """The whole calls these pieces make (each call's pieces all here, its first one first)."""
        calls: dict[int, ToolCall] = {}
        for piece in self.tool_calls:
            if piece.id is not None:
                assert piece.name is not None  # a call's first piece names it
                calls[piece.index] = ToolCall(piece.id, piece.name, piece.arguments)
            else:
                call = calls[piece.index]
                calls[piece.index] = dataclasses.replace(call, arguments=call.arguments + piece.arguments)
        return list(calls.values())

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


_INVOKE = re.compile(r"\s*<" + DSML + r'invoke name="([^"]+)">\s*')
_PARAMETER = re.compile(r"<" + DSML + r'parameter name="([^"]+)" string="(true|false)">')
_REASONING, _CONTENT, _BLOCK = "reasoning", "content", "block"
# A held block's states (calls_held_by_grammar): between calls, between a call's parameters, in a string value, in
# any other value.
_CALLS, _PARAMS, _STRING, _VALUE = "calls", "params", "string", "value"
_INVOKE_START = "<" + DSML + 'invoke name="'
_PARAMETER_START = "<" + DSML + 'parameter name="'


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
        self._held = options.calls_held_by_grammar
        self._calls_left = None if options.parallel_tool_calls else 1  # parallel_tool_calls false: the first only
        # A continued assistant message has its reasoning closed already: the model goes on with the answer.
        self._state = _REASONING if options.thinking and not options.continue_final_message else _CONTENT
        self._buffer = ""
        self._at_start = True  # a leading <think> in thinking mode is the model repeating the prompt's
        self._block_lead = ""  # the separator read before the open block, given back if the block is text
        self.num_calls = 0  # the calls begun so far
        self._params = 0  # the parameters of the call being streamed, so far
        self._value_key = ""  # what goes before the JSON value being read: "{" or ", ", its key and ": "
        prefix = options.answer_prefix
        if prefix:
            self._open_block(prefix[len(TOOL_CALLS_SEPARATOR) + len(TOOL_CALLS_OPEN) :])

    @property
    def _markers(self) -> tuple[str, ...]:
        block = (TOOL_CALLS_SEPARATOR + TOOL_CALLS_OPEN, TOOL_CALLS_OPEN) if self._tools else ()
        return (THINK_END, *block) if self._state == _REASONING else (THINK_START, THINK_END, *block)

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        return self._advance(final=True)

    def _open_block(self, rest: str) -> None:
        """The text after a block's opening tag is `rest`."""
        self._state, self._buffer = (_CALLS, rest) if self._held else (_BLOCK, TOOL_CALLS_OPEN + rest)

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self._state in (_CALLS, _PARAMS, _STRING, _VALUE):
                if not self._stream_block(out, final):
                    return out
                continue
            if self._state == _BLOCK:
                if not self._whole_block(out, final):
                    return out
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
                    self._block_lead = marker[: -len(TOOL_CALLS_OPEN)]
                    self._open_block(rest)
                continue
            keep = 0 if final else _held_suffix(self._buffer, self._markers)
            self._emit(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def _whole_block(self, out: ParsedDelta, final: bool) -> bool:
        """A block held whole: its calls once it closes, or all of it as text. False: wait for more text."""
        end = self._buffer.find(TOOL_CALLS_CLOSE)
        if end < 0 and not final:
            return False
        block_end = len(self._buffer) if end < 0 else end + len(TOOL_CALLS_CLOSE)
        calls = None if end < 0 else parse_tool_block(self._buffer[len(TOOL_CALLS_OPEN) : end])
        if calls is None:  # not DSML after all: the block is text
            out.content += self._block_lead + self._buffer[:block_end]
        else:
            if self._calls_left is not None:
                calls, self._calls_left = calls[: self._calls_left], max(0, self._calls_left - len(calls))
            for name, arguments in calls:
                out.tool_calls.append(ToolCallDelta(self.num_calls, arguments, _call_id(), name))
                self.num_calls += 1
        self._buffer = self._buffer[block_end:]
        self._state = _CONTENT
        return True

    def _stream_block(self, out: ParsedDelta, final: bool) -> bool:
        """One step through a block the grammar holds, streaming its calls. False: wait for more text."""
        if self._state == _STRING:
            end = self._buffer.find(PARAMETER_CLOSE)
            if end < 0:
                keep = 0 if final else _held_suffix(self._buffer, (PARAMETER_CLOSE,))
                text, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
                if text:
                    out.tool_calls.append(ToolCallDelta(self.num_calls - 1, to_json(text)[1:-1]))
                return False
            fragment = to_json(self._buffer[:end])[1:-1] + '"'
            out.tool_calls.append(ToolCallDelta(self.num_calls - 1, fragment))
            self._buffer, self._state = self._buffer[end + len(PARAMETER_CLOSE) :], _PARAMS
            return True
        if self._state == _VALUE:
            end = self._buffer.find(PARAMETER_CLOSE)
            if end < 0:
                return False  # a JSON value goes out whole, as the whole parse writes it (see _argument)
            value = self._value_key + _argument(self._buffer[:end], is_string=False)
            out.tool_calls.append(ToolCallDelta(self.num_calls - 1, value))
            self._buffer, self._state = self._buffer[end + len(PARAMETER_CLOSE) :], _PARAMS
            return True
        self._buffer = self._buffer.lstrip()
        if self._state == _CALLS:
            if self._buffer.startswith(TOOL_CALLS_CLOSE):
                self._buffer, self._state = self._buffer[len(TOOL_CALLS_CLOSE) :], _CONTENT
                return True
            invoke = _INVOKE.match(self._buffer)
            if invoke is not None:  # the name is whole
                out.tool_calls.append(ToolCallDelta(self.num_calls, "", _call_id(), invoke.group(1)))
                self.num_calls += 1
                self._buffer, self._state, self._params = self._buffer[invoke.end() :], _PARAMS, 0
                return True
            expected: tuple[str, ...] = (TOOL_CALLS_CLOSE, _INVOKE_START)
        else:  # _PARAMS
            if self._buffer.startswith(INVOKE_CLOSE):
                out.tool_calls.append(ToolCallDelta(self.num_calls - 1, "}" if self._params else "{}"))
                self._buffer, self._state = self._buffer[len(INVOKE_CLOSE) :], _CALLS
                return True
            parameter = _PARAMETER.match(self._buffer)
            if parameter is not None:
                key = ("{" if self._params == 0 else ", ") + to_json(parameter.group(1)) + ": "
                self._buffer, self._params = self._buffer[parameter.end() :], self._params + 1
                if parameter.group(2) == "true":
                    out.tool_calls.append(ToolCallDelta(self.num_calls - 1, key + '"'))
                    self._state = _STRING
                else:
                    self._state, self._value_key = _VALUE, key
                return True
            expected = (INVOKE_CLOSE, _PARAMETER_START)
        if any(
            marker.startswith(self._buffer) or (self._buffer.startswith(marker) and ">" not in self._buffer)
            for marker in expected
        ):
            if not final:
                return False  # a tag still being written
            self._buffer, self._state = "", _CONTENT  # the output ended inside a tag: markup, not content
            return True
        # Not what the grammar allows (the output ended inside the block): the rest is text.
        out.content += self._buffer
        self._buffer, self._state = "", _CONTENT
        return True

    def _emit(self, out: ParsedDelta, text: str) -> None:
        if self._state == _REASONING:
            out.reasoning += text
        else:
            out.content += text


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_output(text: str, options: ChatOptions) -> ParsedDelta:
    """A whole output at once."""
    parser = ChatOutputParser(options)
    out = parser.feed(text)
    out.extend(parser.finish())
    return out
