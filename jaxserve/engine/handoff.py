"""What a decode server's engine asks of a prefill server, and what comes back (docs/architecture.md,
"Disaggregated prefill and decode"): the engine admits a remote request, asks its StateSource for the request's
state on a worker thread, and installs what arrives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from jaxserve.request import SamplingParams, TokenLogprob
from jaxserve.runner.transfer import Parcel


@dataclass(frozen=True)
class PrefillAsk:
    """One remote request, as its prefill server is asked for it: prefill the prompt, sample the first token as
    `sampling` says, and hand over the state from page `skip_pages` on (the decode server holds the pages before)."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    skip_pages: int


@dataclass(frozen=True)
class Arrival:
    """A prefilled request's state, arrived: the first token and its logprob, the prompt logprobs asked for, and the
    parcel of device state (None when the request asked for no token: max_tokens 0)."""

    token: int | None
    logprob: TokenLogprob | None
    prompt_logprobs: tuple[TokenLogprob, ...] | None
    parcel: Parcel | None


class StateSource(Protocol):
    def fetch(self, ask: PrefillAsk) -> Arrival:
        """The request's state, once a prefill server made it and it arrived here (blocking: the engine calls it on
        a worker thread); raises, naming what failed, when it cannot come."""

    def cancel(self, ask: PrefillAsk) -> None:
        """The request ended here while its state was being made (an abort, a client gone): stop making it, as far
        as one can (the engine calls it on a worker thread; what still arrives is dropped)."""
