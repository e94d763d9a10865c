"""One engine request seen as text: token events in, one Delta per event out (detokenized, stop strings applied).
Both `jaxserve generate` and the HTTP server stream through it.

The request is submitted when the Generation is made, so a refusal (queue full, never fits, draining) raises
before any response has started. Leaving `deltas()` early for any reason (a stop string, the client gone, a
cancelled task) aborts the engine request, so its KV pages go back to the pool.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

from jaxserve.engine import Engine, TokenEvent
from jaxserve.engine.handoff import StateSource
from jaxserve.request import FinishReason, SamplingParams, TokenLogprob
from jaxserve.text.stop_strings import StopStrings


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the output (vLLM's field)
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when the request asked
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # on the first delta, when the request asked
    cached_tokens: int = 0  # prompt tokens the prefix cache had
    num_generated: int = 0  # the output's tokens with this delta's (a consumer may read it after later ones came)


class Observer(Protocol):
    """Per-request timing hooks (the metrics)."""

    def on_tokens(self, count: int, now: float) -> None: ...

    def on_finish(self, reason: FinishReason, now: float) -> None: ...


@dataclass
class Output:
    """A whole output, accumulated from Deltas (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when the request asked
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    cached_tokens: int = 0

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or ())
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.error = delta.finish_reason, delta.stop_reason, delta.error


class Generation:
    def __init__(
        self,
        engine: Engine,
        tokenizer,
        prompt_ids: list[int],
        sampling: SamplingParams,
        stop: tuple[str, ...],
        request_id: str,
        observer: Observer | None = None,
        keep_markup: bool = False,
        priority: int = 0,
        include_stop: bool = False,
        remote: StateSource | None = None,
    ):
        """`keep_markup`: the text keeps the reasoning and tool-call markup (for the chat output parser);
        `priority`, `remote`: see Engine.submit; `include_stop`: a matched stop string stays at the end of the text."""
        self.handle = engine.submit(prompt_ids, sampling, request_id=request_id, priority=priority, remote=remote)
        self._sampling = sampling
        self.num_generated = 0
        self._engine = engine
        self._detokenizer = tokenizer.detokenizer(keep_markup=keep_markup)
        self._stops = StopStrings(stop, include_stop)
        self._observer = observer
        self._finish_reason: FinishReason | None = None
        self._stop_string: str | None = None

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """One Delta per engine event, the last one with a finish reason. Use under `contextlib.aclosing`, so
        leaving early aborts the request at once rather than whenever the generator is collected."""
        engine_done = False
        try:
            async with aclosing(self.handle.events()) as events:
                async for event in events:
                    engine_done = event.finished
                    delta = self._delta(event)
                    if self._observer is not None and delta.token_ids:
                        self._observer.on_tokens(len(delta.token_ids), time.monotonic())
                    yield delta
                    if delta.finish_reason is not None:
                        return
        finally:
            if not engine_done:  # a stop string (the engine records it as the stop reason), or the consumer left
                self._engine.abort(self.handle.request_id, self._finish_reason or FinishReason.ABORT, self._stop_string)
            if self._observer is not None:
                self._observer.on_finish(self._finish_reason or FinishReason.ABORT, time.monotonic())

    async def output(self) -> Output:
        """The whole output, once finished."""
        output = Output()
        async with aclosing(self.deltas()) as deltas:
            async for delta in deltas:
                output.add(delta)
        return output

    def _delta(self, event: TokenEvent) -> Delta:
        """The event's text. An event may carry several tokens (a verify step's run): stop strings are looked for
        token by token, so a stop ends the delta at the token that completes it, as if each had come alone."""
        text, stop, kept = "", None, 0
        for token in event.token_ids:
            kept += 1
            self.num_generated += 1
            piece, stop = self._looked_for_stops(self._detokenizer.step(token))
            text += piece
            if stop is not None:
                break
        if stop is None and event.finished:
            piece, stop = self._looked_for_stops(self._detokenizer.flush())
            text += piece
        token_ids = event.token_ids[:kept]
        finish_reason: FinishReason | None
        stop_reason: int | str | None
        if stop is not None:
            finish_reason, stop_reason, self._stop_string = FinishReason.STOP, stop, stop
        else:
            finish_reason, stop_reason = event.finish_reason, event.stop_reason
            if event.finished:
                text += self._stops.flush()
        self._finish_reason = finish_reason
        logprobs = None if event.logprobs is None else event.logprobs[: len(token_ids)]
        return Delta(
            text,
            token_ids,
            finish_reason,
            stop_reason,
            event.error,
            logprobs,
            event.prompt_logprobs,
            event.cached_tokens,
            self.num_generated,
        )

    def _looked_for_stops(self, piece: str) -> tuple[str, str | None]:
        """The next piece of text, cut at a stop string it completes (the stop, or None); stop strings are looked
        for only once the request may stop (min_tokens)."""
        return self._stops.feed(piece) if self._sampling.may_stop(self.num_generated) else (piece, None)
