"""OpenAI response bodies and stream chunks, for the completions and the chat endpoint.

With vLLM's `return_token_ids`, completions carry `prompt_token_ids` (first chunk only when streaming) and
`token_ids` in the choice; chat carries `prompt_token_ids` at the top level and `token_ids` in the choice.

Chat output goes through DeepSeek-V4's output parser: `reasoning_content`, `content` and `tool_calls` (each call
streamed as OpenAI streams them: id and name first, then `arguments` fragments; see jaxserve.text.chat.output for when
a call streams as it is written and when it is held whole), and `finish_reason: tool_calls` when the model called
tools.

Logprobs come in the shapes OpenAI's API uses. Completions: `{tokens, token_logprobs, top_logprobs,
text_offset}`, where each `top_logprobs` entry maps token text to logprob for the top k and the chosen token (a
text shared by several tokens keeps the best of theirs); with `echo` the prompt's tokens come first, the first of
them with null logprobs. Chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
With vLLM's `return_tokens_as_token_ids`, logprobs name each token `token_id:<id>` rather than by its text (texts
can repeat; ids cannot). A batch of prompts (completions) has `n` choices per prompt, choice `i * n + j` being
prompt i's choice j, each carrying its `index`; the usage counts each prompt once.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from jaxserve.request import FinishReason, TokenLogprob
from jaxserve.server.protocol import GenerationParams
from jaxserve.text.chat import ChatOptions, ChatOutputParser, ParsedDelta, parse_output
from jaxserve.text.chat.encoding import THINK_END
from jaxserve.text.generation import Delta, Output
from jaxserve.text.tokenizer import token_id_text


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _Format:
    id_prefix: str
    chunk_object: str
    response_object: str
    keeps_markup = False  # whether the output text keeps the chat markup (for a parser) or drops special tokens

    def __init__(self, model: str, prompts: list[list[int]], tokenizer, params: GenerationParams):
        """`prompts`: the token ids of each prompt (chat: one), each with `params.n` choices: choice `index`
        answers prompt `index // n`, as OpenAI numbers a batch's choices. `tokenizer` names the tokens in logprobs
        (`params.tokens_as_ids`: by id instead); the request's own `params` say what the output carries
        (`logprobs`: the alternatives per token, None for none; vLLM's `prompt_logprobs`, likewise for each prompt
        position; `return_token_ids`)."""
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.prompts = prompts
        self.n = params.n
        self.num_choices = len(prompts) * self.n
        self.return_token_ids = params.return_token_ids
        self.tokenizer = tokenizer
        self.logprobs = params.logprobs is not None
        self.top_k = params.logprobs or 0
        self.tokens_as_ids = params.tokens_as_ids
        self.prompt_logprobs = params.prompt_logprobs
        self._cached = [0] * self.num_choices  # each choice's prompt tokens the prefix cache had

    def request_id(self, choice: int) -> str:
        """The engine request id of choice `choice`."""
        return self.id if self.num_choices == 1 else f"{self.id}-{choice}"

    def prompt_ids(self, choice: int) -> list[int]:
        """The prompt choice `choice` answers."""
        return self.prompts[choice // self.n]

    def token_text(self, token_id: int) -> str:
        """How logprobs name a token."""
        return token_id_text(token_id) if self.tokens_as_ids else self.tokenizer.token_text(token_id)

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _choice(
        self, index: int, body: dict, finish_reason: str | None, stop_reason, token_ids, logprobs: dict | None
    ) -> dict:
        choice = {
            "index": index,
            **body,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def opening_chunks(self) -> list[dict]:
        """Chunks sent before the first token (none for completions)."""
        return []

    def usage_chunk(self, completion_tokens: int) -> dict:
        return self._envelope(
            self.chunk_object, [], usage={**usage(self._prompt_tokens(), completion_tokens), **self._usage_details()}
        )

    def _usage(self, outputs: list[Output], completion_tokens: int | None) -> dict:
        """`completion_tokens`: what was generated, when more than `outputs` hold (best_of)."""
        if completion_tokens is None:
            completion_tokens = sum(len(o.token_ids) for o in outputs)
        for index, output in enumerate(outputs):
            self.note_cached(index, output.cached_tokens)
        return {**usage(self._prompt_tokens(), completion_tokens), **self._usage_details()}

    def note_cached(self, index: int, cached_tokens: int) -> None:
        """Choice `index`'s prompt tokens the prefix cache had (from its deltas)."""
        self._cached[index] = max(self._cached[index], cached_tokens)

    def _usage_details(self) -> dict:
        """What the usage adds to its token counts: OpenAI's cached prompt tokens (each prompt counted once, as
        its first choice found it), and for chat the reasoning tokens."""
        return {"prompt_tokens_details": {"cached_tokens": sum(self._cached[:: self.n])}}

    def with_usage(self, chunk: dict, completion_tokens: int) -> dict:
        """`chunk` (of one choice) with that choice's usage so far."""
        prompt = self.prompt_ids(chunk["choices"][0]["index"])
        return {**chunk, "usage": usage(len(prompt), completion_tokens)}

    def _prompt_logprobs(self, logprobs) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}
        for the token there and the k best (rank 1 is the best; null where the token is not among the
        MAX_LOGPROBS the device computed)."""
        if self.prompt_logprobs is None:
            return None
        result: list[dict | None] = [None]
        for lp in logprobs or ():
            ranked = {token_id: (rank, value) for rank, (token_id, value) in enumerate(lp.top, 1)}
            entries = {lp.token_id: (ranked.get(lp.token_id, (None, lp.logprob))[0], lp.logprob)}
            entries.update({t: ranked[t] for t, _ in lp.top[: self.prompt_logprobs]})
            result.append(
                {
                    str(t): {"logprob": value, "rank": rank, "decoded_token": self.token_text(t)}
                    for t, (rank, value) in entries.items()
                }
            )
        return result

    def _prompt_tokens(self) -> int:
        """Every prompt counted once, however many choices it has."""
        return sum(len(p) for p in self.prompts)


@dataclass(frozen=True)
class Echo:
    """A prompt as `echo` returns it: the text the client sent (special tokens written in it stay), or the decoded
    ids of a token-id prompt (special tokens left out, as in any output text)."""

    text: str
    shows_special_tokens: bool


class CompletionFormat(_Format):
    id_prefix, chunk_object, response_object = "cmpl", "text_completion", "text_completion"

    def __init__(
        self,
        model: str,
        prompts: list[list[int]],
        tokenizer,
        params: GenerationParams,
        *,
        echoes: list[Echo] | None = None,
    ):
        """`echoes`: each prompt as `echo` returns it, when the request asked for it."""
        super().__init__(model, prompts, tokenizer, params)
        self.echoes = echoes
        # text_offset indexes the text returned: each choice's output tokens are decoded again as the output text
        # was (complete characters, no special tokens), after the echo's length.
        self._texts = [tokenizer.detokenizer() for _ in range(self.num_choices)] if self.logprobs else []
        self._text_start = [0] * self.num_choices
        self._started: set[int] = set()  # choices that have had a chunk

    def token_name(self, token_id: int) -> str:
        """How completions' logprobs name a token (in `tokens` and as a `top_logprobs` key): its text, or, for a
        token that ends inside a UTF-8 character, OpenAI's `bytes:\\xNN...` (each such piece's text is U+FFFD, so
        they would all share one key)."""
        if self.tokens_as_ids:
            return token_id_text(token_id)
        raw = self.tokenizer.token_bytes(token_id)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return self.tokenizer.token_text(token_id)

    def _first(self, index: int) -> bool:
        """Whether this is choice `index`'s first chunk (and mark it sent)."""
        first = index not in self._started
        self._started.add(index)
        return first

    def chunk(self, index: int, delta: Delta) -> dict:
        first = self._first(index)
        text, logprobs = self._text_and_logprobs(index, delta.text, delta.logprobs, delta.prompt_logprobs, first)
        choice = self._choice(index, {"text": text}, delta.finish_reason, delta.stop_reason, delta.token_ids, logprobs)
        if self.return_token_ids and first:
            choice["prompt_token_ids"] = self.prompt_ids(index)
        return self._envelope(self.chunk_object, [choice])

    def response(self, outputs: list[Output], completion_tokens: int | None = None) -> dict:
        choices = []
        for index, output in enumerate(outputs):
            text, logprobs = self._text_and_logprobs(index, output.text, output.logprobs, output.prompt_logprobs, True)
            choice = self._choice(
                index, {"text": text}, output.finish_reason, output.stop_reason, output.token_ids, logprobs
            )
            if self.return_token_ids:
                choice["prompt_token_ids"] = self.prompt_ids(index)
            if self.prompt_logprobs is not None:  # vLLM's, in the choice
                choice["prompt_logprobs"] = self._prompt_logprobs(output.prompt_logprobs)
            choices.append(choice)
        return self._envelope(self.response_object, choices, usage=self._usage(outputs, completion_tokens))

    def _text_and_logprobs(self, index: int, text: str, logprobs, prompt_logprobs, first: bool):
        echo = self.echoes[index // self.n] if first and self.echoes is not None else None
        if echo is not None:
            text = echo.text + text
        if not self.logprobs:
            return text, None
        result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if echo is not None:  # the first prompt token has no logprob: nothing comes before it
            prompt_ids = self.prompt_ids(index)
            entries: list[tuple[int, TokenLogprob | None]] = [(prompt_ids[0], None)]
            entries += [(lp.token_id, lp) for lp in prompt_logprobs or ()]
            echoed = self.tokenizer.detokenizer(skip_special_tokens=not echo.shows_special_tokens)
            self._add(result, entries, echoed, 0)
            self._text_start[index] = len(echo.text)
        self._add(result, [(lp.token_id, lp) for lp in logprobs or ()], self._texts[index], self._text_start[index])
        return text, result

    def _add(self, result: dict[str, list], entries: list[tuple[int, TokenLogprob | None]], text, start: int) -> None:
        """Append `entries` (token id, logprob or None) to `result`; `text` decodes them as the returned text
        does, which starts at `start` there."""
        for token_id, logprob in entries:
            result["tokens"].append(self.token_name(token_id))
            before = len(text.text)
            piece = text.step(token_id)
            own = self.tokenizer.token_text(token_id)
            # A token's text ends what it added (which may begin with the U+FFFD of a broken character before it);
            # a piece of a character, or a special token the text leaves out, sits where the text then stood.
            at = len(text.text) - len(own) if own and piece.endswith(own) else before
            result["text_offset"].append(start + at)
            if logprob is None:
                result["token_logprobs"].append(None)
                result["top_logprobs"].append(None)
                continue
            result["token_logprobs"].append(logprob.logprob)
            top: dict[str, float] = {}
            # Best first: when two tokens have one name (the same text), the likelier one is kept.
            for top_id, value in logprob.top[: self.top_k] + ((token_id, logprob.logprob),):
                top.setdefault(self.token_name(top_id), value)
            result["top_logprobs"].append(top)


class ChatFormat(_Format):
    id_prefix, chunk_object, response_object = "chatcmpl", "chat.completion.chunk", "chat.completion"
    keeps_markup = True

    def __init__(
        self,
        model: str,
        prompt_ids: list[int],
        tokenizer,
        params: GenerationParams,
        *,
        options: ChatOptions = ChatOptions(),
        include_reasoning: bool = True,
        echo: str = "",
    ):
        """`include_reasoning` (vLLM's): false leaves the reasoning out of the reply; `echo` (vLLM's chat echo): the
        text each reply's content starts with."""
        super().__init__(model, [prompt_ids], tokenizer, params)
        n = self.n
        self.options = options
        self.include_reasoning = include_reasoning
        self.echo = echo
        # Reasoning tokens (OpenAI's usage.completion_tokens_details): each choice's tokens before its </think>.
        self._think_end = tokenizer.token_to_id(THINK_END) if tokenizer.has_text else None
        self._still_reasoning = [options.thinking and not options.continue_final_message] * n
        self._reasoning_tokens = [0] * n
        self._parsers = [ChatOutputParser(options) for _ in range(n)]

    def _prompt_ids(self) -> dict:
        return {"prompt_token_ids": self.prompts[0]} if self.return_token_ids else {}

    def opening_chunks(self) -> list[dict]:
        # As OpenAI and vLLM do: the role first, with no content yet.
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(self.n)
        ]
        chunks = [self._envelope(self.chunk_object, [choice], **self._prompt_ids()) for choice in choices]
        if self.echo:  # then the echoed text, as vLLM sends it
            chunks += [
                self._envelope(
                    self.chunk_object,
                    [{"index": i, "delta": {"content": self.echo}, "logprobs": None, "finish_reason": None}],
                )
                for i in range(self.n)
            ]
        return chunks

    def chunk(self, index: int, delta: Delta) -> dict:
        self._count_reasoning(index, delta.token_ids)
        parser = self._parsers[index]
        parsed = parser.feed(delta.text)
        if delta.finish_reason is not None:
            parsed.extend(parser.finish())
        body: dict = {"content": parsed.content}  # always a string, as before: clients concatenate it
        if parsed.reasoning and self.include_reasoning:
            body.update(self._reasoning(parsed.reasoning))
        if parsed.tool_calls:  # a call's id and name first, then its arguments as they come
            body["tool_calls"] = [piece.to_openai() for piece in parsed.tool_calls]
        finish = self._finish_reason(delta.finish_reason, parser.num_calls > 0)
        logprobs = self._logprobs(delta.logprobs) if self.logprobs and delta.token_ids else None
        return self._envelope(
            self.chunk_object,
            [self._choice(index, {"delta": body}, finish, delta.stop_reason, delta.token_ids, logprobs)],
        )

    def response(self, outputs: list[Output], completion_tokens: int | None = None) -> dict:
        choices = []
        for index, output in enumerate(outputs):
            self._count_reasoning(index, output.token_ids)
            parsed = parse_output(output.text, self.options)
            message = self._message(parsed, self.include_reasoning)
            if self.echo:
                message["content"] = self.echo + (message["content"] or "")
            choices.append(
                self._choice(
                    index,
                    {"message": message},
                    self._finish_reason(output.finish_reason, bool(message.get("tool_calls"))),
                    output.stop_reason,
                    output.token_ids,
                    self._logprobs(output.logprobs) if self.logprobs else None,
                )
            )
        extra = self._prompt_ids()
        if self.prompt_logprobs is not None:  # vLLM's, at the top level of a chat completion
            extra["prompt_logprobs"] = self._prompt_logprobs(outputs[0].prompt_logprobs)
        return self._envelope(self.response_object, choices, usage=self._usage(outputs, completion_tokens), **extra)

    def _logprobs(self, logprobs) -> dict:
        def entry(token_id: int, value: float) -> dict:
            token = self.token_text(token_id)
            # A token's own bytes (one that ends inside a character is not U+FFFD's); by id, the name's, as vLLM.
            raw = token.encode("utf-8") if self.tokens_as_ids else self.tokenizer.token_bytes(token_id)
            return {"token": token, "logprob": value, "bytes": list(raw)}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in logprobs or ()
            ]
        }

    def _count_reasoning(self, index: int, token_ids) -> None:
        for token in token_ids:
            if not self._still_reasoning[index]:
                return
            if token == self._think_end:
                self._still_reasoning[index] = False
            else:
                self._reasoning_tokens[index] += 1

    def _usage_details(self) -> dict:
        reasoning = {"completion_tokens_details": {"reasoning_tokens": sum(self._reasoning_tokens)}}
        return {**super()._usage_details(), **reasoning}

    @staticmethod
    def _reasoning(reasoning: str | None) -> dict:
        # Current vLLM clients read `reasoning`; older ones (and DeepSeek's API) `reasoning_content`.
        return {"reasoning": reasoning, "reasoning_content": reasoning}

    @classmethod
    def _message(cls, parsed: ParsedDelta, include_reasoning: bool) -> dict:
        message: dict = {
            "role": "assistant",
            "content": parsed.content if parsed.content or not parsed.tool_calls else None,
            **(cls._reasoning(parsed.reasoning or None) if include_reasoning else {}),
        }
        if calls := parsed.calls():
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message

    @staticmethod
    def _finish_reason(reason: FinishReason | None, called: bool) -> str | None:
        # A turn that ends after calling tools finishes with "tool_calls", as OpenAI's does; "length" stays.
        return "tool_calls" if reason is FinishReason.STOP and called else reason
