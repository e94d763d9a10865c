"""The prefill manager: a FIFO queue of prompts, admitted against KV pages and slots, cut into chunks.

Admission reserves every page a request can ever need (`prompt_len + max_tokens` tokens) plus a slot, so a
running request never has to wait for memory and nothing is ever preempted. A request whose prefill has been
fully scheduled leaves this manager; the Scheduler hands it to the decode manager as that batch is scheduled
(`Scheduler.schedule`).
"""

from __future__ import annotations

from collections import deque

from jaxserve.cache import pages_needed
from jaxserve.request import PrefillChunk, Request, RequestStatus
from jaxserve.scheduler.allocator import Exhausted, IdAllocator


class PrefillManager:
    def __init__(self, page_pool: IdAllocator, page_size: int, max_prefill_tokens: int, max_prefill_rows: int,
                 slots: IdAllocator):
        for name, value in (("page_size", page_size), ("max_prefill_tokens", max_prefill_tokens),
                            ("max_prefill_rows", max_prefill_rows)):
            if value <= 0:
                raise ValueError(f"{name}={value}: must be positive")
        self.page_pool = page_pool
        self.page_size = page_size
        self.max_prefill_tokens = max_prefill_tokens  # token budget of one step (--chunked-prefill-size)
        self.max_prefill_rows = max_prefill_rows  # chunks (requests) in one step
        self.slots = slots
        self.max_active = slots.size  # admitted, unfinished requests (lowered while big decode steps are missing)
        # Arrival order. Only the last chunk of a batch can be partial, so a request whose prompt is part-way
        # done is always at the head: continuing it first and FIFO admission are the same walk.
        self._queue: deque[Request] = deque()

    @property
    def num_waiting(self) -> int:
        return sum(r.status is RequestStatus.WAITING for r in self._queue)

    @property
    def has_work(self) -> bool:
        return bool(self._queue)

    def add(self, request: Request) -> None:
        """Queue `request`, which Engine.check_admission accepted: it fits the pool once it is empty, so it never
        waits at the head forever."""
        request.status = RequestStatus.WAITING
        self._queue.append(request)

    def schedule_next_chunks(self, token_budget: int | None = None) -> tuple[PrefillChunk, ...]:
        """The next prefill step's chunks (empty: nothing to prefill). Scheduling is the commitment:
        `num_prefilled` advances now.

        `token_budget` lowers this step's budget below max_prefill_tokens (adaptive chunking)."""
        chunks: list[PrefillChunk] = []
        budget = min(self.max_prefill_tokens, token_budget or self.max_prefill_tokens)
        while self._queue and budget > 0 and len(chunks) < self.max_prefill_rows:
            request = self._queue[0]
            if request.status is RequestStatus.WAITING and not self._admit(request):
                break  # FIFO: nobody overtakes a head that does not fit yet
            length = min(request.remaining_prompt, budget)
            chunks.append(PrefillChunk(request, request.num_prefilled, length))
            request.num_prefilled += length
            budget -= length
            if request.prefill_done:
                self._queue.popleft()
        return tuple(chunks)

    def remove(self, request: Request) -> None:
        """Forget `request` wherever it is in its life (release() gives back its pages and slot)."""
        if request in self._queue:
            self._queue.remove(request)

    def release(self, request: Request) -> None:
        """Give back `request`'s pages and slot, each exactly once."""
        if request.pages:
            self.page_pool.free(request.pages)
            request.pages = []
        if request.slot is not None:
            self.slots.free([request.slot])
            request.slot = None

    def _admit(self, request: Request) -> bool:
        if self.slots.num_used >= self.max_active:  # max_active <= the slots there are
            return False
        try:
            request.pages = self.page_pool.allocate(pages_needed(request.max_total_len, self.page_size))
        except Exhausted:
            return False
        request.slot, = self.slots.allocate(1)
        request.status = RequestStatus.PREFILLING
        return True
