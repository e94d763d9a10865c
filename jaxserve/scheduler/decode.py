"""The decode manager: the requests whose prompt is done; each decode step advances all of them by one token."""

from __future__ import annotations

from jaxserve.request import Request, RequestStatus
from jaxserve.request.step import StepRow


class DecodeManager:
    def __init__(self, max_num_seqs: int, draft_tokens: int = 0):
        """`draft_tokens`: speculative decoding's drafts per row (0: none), whose rows may keep that many more
        tokens."""
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={max_num_seqs}: must be positive")
        self.max_num_seqs = max_num_seqs
        self.draft_tokens = draft_tokens
        # Insertion order is the order prompts completed.
        self._running: dict[str, Request] = {}

    @property
    def running(self) -> list[Request]:
        return list(self._running.values())

    @property
    def has_work(self) -> bool:
        return bool(self._running)

    def add(self, request: Request) -> None:
        if request.request_id in self._running:
            raise ValueError(f"request {request.request_id!r} is already decoding")
        request.move_to(RequestStatus.DECODING)
        self._running[request.request_id] = request

    def remove(self, request: Request) -> None:
        """Stop decoding `request`; a no-op if it is not here (e.g. it finished on its first token)."""
        if self._running.get(request.request_id) is request:
            del self._running[request.request_id]

    def schedule_next_rows(self, max_rows: int) -> tuple[StepRow, ...]:
        """The decode rows of the next step (oldest first, at most `max_rows`); empty when none is decoding. A
        request whose last token (max_tokens) is already being sampled by a step in flight gets no further row."""
        due = [r for r in self._running.values() if r.num_sampled < r.sampling.max_tokens][:max_rows]
        return tuple(StepRow.next_token(request, self.draft_tokens) for request in due)
