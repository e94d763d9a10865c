"""OpenAI response bodies and stream chunks, for the completions and the chat endpoint.

With vLLM's `return_token_ids`, completions carry `prompt_token_ids` (first chunk only when streaming) and
`token_ids` in the choice; chat carries `prompt_token_ids` at the top level and `token_ids` in the choice.

Chat output goes through DeepSeek-V4's output parser: `reasoning_content`, `content` and `tool_calls` (each call
whole, in the chunk where its block closed), and `finish_reason: tool_calls` when the model called tools.
"""

from __future__ import annotations

import time
import uuid

from jaxserve.chat import ChatOptions, ChatOutputParser, ParsedDelta, parse_output
from jaxserve.generation import Delta, Output


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Format:
    id_prefix: str
    chunk_object: str
    response_object: str
    keeps_markup = False  # whether the output text keeps the chat markup (for a parser) or drops special tokens

    def __init__(self, model: str, prompt_ids: list[int], return_token_ids: bool):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.prompt_ids = prompt_ids
        self.return_token_ids = return_token_ids

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _choice(self, body: dict, finish_reason: str | None, stop_reason, token_ids) -> dict:
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def opening_chunks(self) -> list[dict]:
        """Chunks sent before the first token (none for completions)."""
        return []

    def usage_chunk(self, completion_tokens: int) -> dict:
        return self._envelope(self.chunk_object, [], usage=usage(len(self.prompt_ids), completion_tokens))


class CompletionFormat(_Format):
    id_prefix, chunk_object, response_object = "cmpl", "text_completion", "text_completion"

    def chunk(self, delta: Delta, first: bool) -> dict:
        choice = self._choice({"text": delta.text}, delta.finish_reason, delta.stop_reason, delta.token_ids)
        if self.return_token_ids and first:
            choice["prompt_token_ids"] = self.prompt_ids
        return self._envelope(self.chunk_object, [choice])

    def response(self, output: Output) -> dict:
        choice = self._choice({"text": output.text}, output.finish_reason, output.stop_reason, output.token_ids)
        if self.return_token_ids:
            choice["prompt_token_ids"] = self.prompt_ids
        return self._envelope(self.response_object, [choice], usage=usage(len(self.prompt_ids), len(output.token_ids)))


class ChatFormat(_Format):
    id_prefix, chunk_object, response_object = "chatcmpl", "chat.completion.chunk", "chat.completion"
    keeps_markup = True

    def __init__(self, model: str, prompt_ids: list[int], return_token_ids: bool,
                 options: ChatOptions = ChatOptions()):
        super().__init__(model, prompt_ids, return_token_ids)
        self.options = options
        self._parser = ChatOutputParser(options)
        self._num_calls = 0

    def _prompt_ids(self) -> dict:
        return {"prompt_token_ids": self.prompt_ids} if self.return_token_ids else {}

    def opening_chunks(self) -> list[dict]:
        # As OpenAI and vLLM do: the role first, with no content yet.
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._envelope(self.chunk_object, [choice], **self._prompt_ids())]

    def chunk(self, delta: Delta, first: bool) -> dict:
        parsed = self._parser.feed(delta.text)
        if delta.finish_reason is not None:
            parsed.extend(self._parser.finish())
        body: dict = {"content": parsed.content}  # always a string, as before: clients concatenate it
        if parsed.reasoning:
            body["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            body["tool_calls"] = [{"index": self._num_calls + k, **call.to_openai()}
                                  for k, call in enumerate(parsed.tool_calls)]
            self._num_calls += len(parsed.tool_calls)
        finish = self._finish_reason(delta.finish_reason, self._num_calls > 0)
        choice = self._choice({"delta": body}, finish, delta.stop_reason, delta.token_ids)
        return self._envelope(self.chunk_object, [choice])

    def response(self, output: Output) -> dict:
        parsed = parse_output(output.text, self.options)
        choice = self._choice({"message": self._message(parsed)},
                              self._finish_reason(output.finish_reason, bool(parsed.tool_calls)),
                              output.stop_reason, output.token_ids)
        return self._envelope(self.response_object, [choice], usage=usage(len(self.prompt_ids), len(output.token_ids)),
                              **self._prompt_ids())

    @staticmethod
    def _message(parsed: ParsedDelta) -> dict:
        message = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.tool_calls else None,
                   "reasoning_content": parsed.reasoning or None}
        if parsed.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        return message

    @staticmethod
    def _finish_reason(reason: str | None, called: bool) -> str | None:
        # A turn that ends after calling tools finishes with "tool_calls", as OpenAI's does; "length" stays.
        return "tool_calls" if reason == "stop" and called else reason
