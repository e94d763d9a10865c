"""The prefill manager: the waiting queue (in the queue order's order), admission against KV pages and slots, and
the cut of prompts into chunks.

Admission reserves every page a request can ever need (`prompt_len + max_tokens` tokens) plus a slot, so a
running request never has to wait for memory and nothing is ever preempted; the prefix cache (the pages' owner)
shares the cached pages a prompt starts with, counted once, and the prefill starts after them. Admitted requests
are continued before anyone new is admitted, in admission order; a request whose prefill has been fully scheduled
leaves this manager (the Scheduler hands it to the decode manager as that step is scheduled).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque

from jaxserve.request import Request, RequestStatus
from jaxserve.request.step import StepRow
from jaxserve.scheduler.allocator import IdAllocator
from jaxserve.scheduler.prefix_cache import PrefixCache
from jaxserve.scheduler.queue_order import FirstComeFirstServed, QueueOrder


class PrefillManager:
    def __init__(
        self,
        pages: PrefixCache | IdAllocator,
        page_size: int,
        max_prefill_tokens: int,
        max_prefill_rows: int,
        slots: IdAllocator,
        queue_order: QueueOrder | None = None,
    ):
        for name, value in (
            ("page_size", page_size),
            ("max_prefill_tokens", max_prefill_tokens),
            ("max_prefill_rows", max_prefill_rows),
        ):
            if value <= 0:
                raise ValueError(f"{name}={value}: must be positive")
        # A bare allocator is a prefix cache that caches nothing.
        self.pages = pages if isinstance(pages, PrefixCache) else PrefixCache(pages, page_size)
        self.page_size = page_size
        self.max_prefill_tokens = max_prefill_tokens  # token budget of one step (--chunked-prefill-size)
        self.max_prefill_rows = max_prefill_rows  # chunks (requests) in one step
        self.slots = slots
        self.queue_order = queue_order or FirstComeFirstServed()
        self._admitted: deque[Request] = deque()  # PREFILLING, prompt not fully scheduled yet; admission order
        self._arriving: list[Request] = []  # PREFILLING remote requests, their state on its way from a prefill server
        self._waiting: list[tuple[tuple[int, ...], int, Request]] = []  # (order key, arrival, request), sorted
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._admitted or self._waiting or self._arriving)

    @property
    def requests(self) -> list[Request]:
        """Every request here: admitted ones first, then the waiting ones in the order they will be admitted."""
        return list(self._admitted) + self._arriving + [request for _, _, request in self._waiting]

    def add(self, request: Request) -> None:
        """Queue `request` (WAITING), which Engine.check_admission accepted: it fits the pool once it is empty, so
        it never waits at the head forever."""
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} is {request.status.value}, not waiting")
        bisect.insort(
            self._waiting, (self.queue_order.key(request), next(self._arrivals), request), key=lambda entry: entry[:2]
        )

    def schedule_next_chunks(self, token_budget: int, max_rows: int, max_active: int) -> tuple[StepRow, ...]:
        """The next step's prefill rows, at most `token_budget` tokens in at most `max_rows` rows, admitting no more
        than `max_active` requests in all (empty: nothing to prefill). Scheduling is the commitment: `num_prefilled`
        advances now. Only the last row of a step can be partial, so at most one admitted request is part-way."""
        rows: list[StepRow] = []
        budget = token_budget
        while budget > 0 and len(rows) < max_rows:
            if not self._admitted and not (self._local_head() and self._admit(self._waiting[0][2], max_active)):
                break  # nothing admitted to continue, and nobody overtakes a head that does not fit yet (or is remote)
            request = self._admitted[0]
            length = min(request.remaining_prompt, budget)
            rows.append(self.pages.chunk(request, request.num_prefilled, length))
            request.num_prefilled += length
            budget -= length
            if request.prefill_done:
                self._admitted.popleft()
        self.pages.commit(rows)  # the step is decided: what it writes can be shared from the next one on
        return tuple(rows)

    def admit_remote(self, max_active: int) -> list[Request]:
        """Admit the remote requests at the head of the queue while they fit, admitting no more than `max_active`
        requests in all: their state is to be fetched now (for the pages after the cached ones they start with)."""
        admitted = []
        while self._waiting and self._waiting[0][2].remote and self._admit(self._waiting[0][2], max_active):
            admitted.append(self._arriving[-1])
        return admitted

    def arrived(self, request: Request) -> None:
        """A remote request's state is in its pages and slot: its prompt is done here."""
        self._arriving.remove(request)
        self.pages.arrived(request)
        request.num_prefilled = request.prompt_len

    def _local_head(self) -> bool:
        return bool(self._waiting) and not self._waiting[0][2].remote

    def remove(self, request: Request) -> None:
        """Forget `request` wherever it is in its life (release() gives back its pages and slot)."""
        if request in self._admitted:
            self._admitted.remove(request)
        if request in self._arriving:
            self._arriving.remove(request)
        self._waiting = [entry for entry in self._waiting if entry[2] is not request]

    def release(self, request: Request) -> None:
        """Give back `request`'s pages and slot, each exactly once."""
        self.pages.release(request)
        if request.slot is not None:
            self.slots.free([request.slot])
            request.slot = None

    def _admit(self, request: Request, max_active: int) -> bool:
        if self.slots.num_used >= max_active:
            return False
        if not self.pages.admit(request):
            return False
        (request.slot,) = self.slots.allocate(1)
        request.move_to(RequestStatus.PREFILLING)
        self._waiting.pop(0)
        (self._arriving if request.remote else self._admitted).append(request)
        return True
