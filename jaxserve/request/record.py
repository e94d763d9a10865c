"""The request record and its lifecycle: one live record per request, from submission to finish (the scheduler plans
steps over it, the engine delivers to it; the runner never sees it, only the step batches made of it)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.request.params import FinishReason, InvalidRequest, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from jaxserve.request.grammar import GrammarMatcher


class TokenOccurrences:
    """Distinct tokens and how many times each came out, grown from a request's output as it lengthens (a step costs
    its new tokens, not the whole text): the arrays the sampler's penalties read."""

    def __init__(self, prompt_ids: list[int]):
        distinct = np.unique(np.asarray(prompt_ids, np.int32))
        self._index = {int(t): i for i, t in enumerate(distinct)}
        self._ids = np.zeros(max(64, 2 * len(distinct)), np.int32)
        self._ids[: len(distinct)] = distinct
        self._counts = np.zeros(len(self._ids), np.float32)
        self._outputs_seen = 0

    def entries(self, output_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts) after counting output_ids' tokens not yet seen; views, valid until the next call."""
        for token in output_ids[self._outputs_seen :]:
            i = self._index.get(token)
            if i is None:
                i = self._index[token] = len(self._index)
                if i == len(self._ids):
                    self._ids = np.resize(self._ids, 2 * i)
                    self._counts = np.resize(self._counts, 2 * i)
                self._ids[i], self._counts[i] = token, 0
            self._counts[i] += 1
        self._outputs_seen = len(output_ids)
        size = len(self._index)
        return self._ids[:size], self._counts[:size]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages or slot
    PREFILLING = "prefilling"  # admitted: pages and slot reserved, prompt partly scheduled into the KV cache
    DECODING = "decoding"  # prompt fully scheduled, in the decode manager
    FINISHED = "finished"  # EOS, a stop, max_tokens or an error; pages and slot freed once no step writes them
    ABORTED = "aborted"  # the client went away or asked (finish reason "abort")


class IllegalTransition(RuntimeError):
    """A request was moved to a state its current one cannot lead to (a bug in whoever moved it)."""


# The one table of a request's legal moves. A request ends in any state it is in (an error, an abort); only an
# admitted request prefills, only a prefilled one decodes, and an ended one never moves again.
LEGAL_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.PREFILLING, RequestStatus.FINISHED, RequestStatus.ABORTED}),
    RequestStatus.PREFILLING: frozenset({RequestStatus.DECODING, RequestStatus.FINISHED, RequestStatus.ABORTED}),
    RequestStatus.DECODING: frozenset({RequestStatus.FINISHED, RequestStatus.ABORTED}),
    RequestStatus.FINISHED: frozenset(),
    RequestStatus.ABORTED: frozenset(),
}


@dataclass(eq=False)  # identity semantics: two requests are never "equal" because their fields match
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None  # when it left the queue (moved to PREFILLING: pages and slot reserved)
    first_token_time: float | None = None  # when its first output token was delivered
    last_token_time: float | None = None  # when its latest output token was delivered
    output_ids: list[int] = field(default_factory=list)
    num_prefilled: int = 0  # prompt tokens already scheduled into the KV cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (never prefilled)
    num_sampled: int = 0  # output tokens sampled by dispatched steps (output_ids lags by the step in flight)
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    priority: int = 0  # lower runs first under --scheduling-policy priority
    # Disaggregated serving: on a prefill server, the page from which its state is handed off once its first token
    # is sampled (None: it decodes here); on a decode server, whether its prompt's state comes from a prefill server.
    hand_off_from: int | None = None
    remote: bool = False
    status: RequestStatus = RequestStatus.WAITING  # changed only by move_to(), along LEGAL_TRANSITIONS
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None for EOS)
    # With sampling.prompt_logprobs: the logprobs of prompt tokens 1.. as their chunks run, delivered with the
    # request's first event.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With sampling.constraint: where the output stands in it (the engine advances it as tokens are delivered).
    grammar: GrammarMatcher | None = None
    # With penalties: the tokens they look at, kept up to date by penalty_entries()
    _occurrences: TokenOccurrences | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not self.prompt_ids:
            raise InvalidRequest(
                "prompt", f"prompt: request {self.request_id!r} is empty (there is no position to sample from)"
            )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_len - self.num_prefilled

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled >= self.prompt_len

    @property
    def total_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    def tokens_before(self, position: int, count: int) -> list[int]:
        """The `count` token ids at positions position - count .. position - 1, oldest first; -1 before the
        sequence's start, and for an output token not delivered yet (only a speculative verify row's tokens before
        it may be in flight; a model that reads them, an Engram's, refuses speculative decoding)."""
        n, known = self.prompt_len, self.prompt_len + len(self.output_ids)
        return [
            -1 if p < 0 or p >= known else self.prompt_ids[p] if p < n else self.output_ids[p - n]
            for p in range(position - count, position)
        ]

    @property
    def decode_position(self) -> int:
        """The position of the token the next decode step feeds: the last one sampled for it by a dispatched step
        (output_ids may not have it yet while that step is in flight)."""
        return self.prompt_len + self.num_sampled - 1

    @property
    def max_total_len(self) -> int:
        return self.prompt_len + self.sampling.max_tokens

    @property
    def finished(self) -> bool:
        """Ended, whatever the reason (aborts included)."""
        return not LEGAL_TRANSITIONS[self.status]

    def move_to(self, status: RequestStatus) -> None:
        """The one way a request changes state; a move the lifecycle does not allow raises IllegalTransition."""
        if status not in LEGAL_TRANSITIONS[self.status]:
            raise IllegalTransition(
                f"request {self.request_id!r}: {self.status.value} -> {status.value} is not a legal move"
            )
        self.status = status
        if status is RequestStatus.PREFILLING:
            self.admitted_time = time.monotonic()

    def penalty_entries(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, output counts) the penalties of the next sample look at: every output token so far with how
        many times it came out, and with a repetition penalty the prompt's other tokens (count 0). The engine
        delivers a step's tokens before the next step samples, so output_ids is up to date when the runner asks."""
        if self._occurrences is None:
            prompt = self.prompt_ids if self.sampling.repetition_penalty != 1 else []
            self._occurrences = TokenOccurrences(prompt)
        return self._occurrences.entries(self.output_ids)

    def note_token(self, token: int) -> None:
        """An output token delivered now."""
        self.output_ids.append(token)
        self.last_token_time = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time

    @property
    def queue_time(self) -> float | None:
        """Seconds from submission to admission (vLLM's queued interval); None if it was never admitted."""
        return None if self.admitted_time is None else self.admitted_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """Seconds from admission to the first output token (vLLM's prefill interval); None before that token."""
        if self.admitted_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.admitted_time

    @property
    def decode_time(self) -> float | None:
        """Seconds from the first output token to the latest (vLLM's decode interval); None before the first."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    def mark_finished(self, reason: FinishReason | str, stop_reason: int | str | None = None) -> None:
        reason = FinishReason(reason)  # a plain word is checked here (ValueError naming it), never compared as text
        self.move_to(RequestStatus.ABORTED if reason is FinishReason.ABORT else RequestStatus.FINISHED)
        self.finish_reason = reason
        self.stop_reason = stop_reason
