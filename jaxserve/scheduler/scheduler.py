"""The per-iteration decision: a prefill batch, a decode batch, or nothing (docs/scheduling.md 0.1).

Request life and the prefill -> decode hand-off (driven by the engine loop):
  add_request -> PrefillManager queue (WAITING) -> admitted, chunks scheduled (PREFILLING)
  -> the batch holding its last chunk runs, the engine samples the first output token and runs stop checks
  -> on_batch_done(batch) moves every completed, unfinished request into the DecodeManager (RUNNING)
  -> finish(request, reason) at EOS / stop / max_tokens / abort: out of both managers, pages and slot freed.
The hand-off waits for the batch to have run because the first decode step feeds the token sampled from the
last chunk; a request finished (or aborted) in between is never handed over.
"""

from __future__ import annotations

import dataclasses

from jaxserve.scheduler.decode import DecodeManager
from jaxserve.scheduler.interleave import DecodeInterleavePolicy
from jaxserve.scheduler.prefill import PrefillManager
from jaxserve.scheduler.request import Batch, DecodeBatch, PrefillBatch, Request, RequestStatus


class Scheduler:
    def __init__(self, prefill_manager: PrefillManager, decode_manager: DecodeManager,
                 interleave_policy: DecodeInterleavePolicy | None = None):
        self.prefill_manager = prefill_manager
        self.decode_manager = decode_manager
        self.interleave_policy = interleave_policy
        self.prefill_steps = 0
        self.decode_steps = 0
        self.forced_decode_steps = 0  # decodes chosen through the policy branch (DecodeBatch.forced)

    @property
    def has_work(self) -> bool:
        return self.prefill_manager.has_work or self.decode_manager.has_work

    def add_request(self, request: Request) -> None:
        self.prefill_manager.add(request)

    def schedule(self) -> Batch | None:
        """The next batch to run, counted in the step statistics."""
        batch = self._schedule_next_batch()
        if isinstance(batch, PrefillBatch):
            self.prefill_steps += 1
        elif isinstance(batch, DecodeBatch):
            self.decode_steps += 1
            self.forced_decode_steps += batch.forced
        return batch

    def _schedule_next_batch(self) -> Batch | None:
        policy = self.interleave_policy
        # A disabled (or absent) policy never wants a decode, so the decode manager is not probed here.
        if policy is not None and policy.wants_decode():
            batch = self.decode_manager.schedule_next_batch()
            if batch is not None:
                policy.note_decode()
                return dataclasses.replace(batch, forced=True)
            # No decode runnable: fall through to prefill; the streak is kept, so the due state latches.
        batch = self.prefill_manager.schedule_next_batch()
        if batch is not None:
            if policy is not None:
                policy.note_prefill()
            return batch
        batch = self.decode_manager.schedule_next_batch()
        if batch is not None and policy is not None:
            policy.note_decode()
        return batch

    def on_batch_done(self, batch: Batch) -> None:
        """Call after `batch` ran and its tokens were delivered: completed prompts start decoding."""
        if isinstance(batch, PrefillBatch):
            for request in batch.completed:
                if request.status is not RequestStatus.FINISHED:
                    self.decode_manager.add(request)

    def finish(self, request: Request, reason: str) -> None:
        """End `request` in any state (also an abort, reason "abort"); frees its pages and slot exactly once."""
        self.decode_manager.remove(request)
        self.prefill_manager.remove(request)
        request.mark_finished(reason)
