"""The per-iteration decision: a prefill step, a decode step, a mixed step, or nothing (docs/scheduling.md).

Request life and the prefill -> decode hand-off (driven by the engine loop):
  add_request -> PrefillManager queue (WAITING) -> admitted, chunks scheduled (PREFILLING)
  -> the batch holding its last chunk is scheduled: the request joins the DecodeManager (RUNNING) at once
  -> that batch runs and samples the first output token; the engine delivers it and runs the stop checks
  -> finish(request, reason) at EOS / stop / max_tokens / abort: out of both managers, pages and slot freed.
The hand-off does not wait for the batch to have run: a decode row's input is the token its slot sampled last,
which stays on the device, so with a step in flight the first decode can be the very next step. A request that
stops on its first token (or is aborted meanwhile) may have had one decode row computed: never delivered.
"""

from __future__ import annotations

from jaxserve.request import Batch, Request
from jaxserve.scheduler.decode import DecodeManager
from jaxserve.scheduler.interleave import DecodeInterleavePolicy
from jaxserve.scheduler.prefill import PrefillManager
from jaxserve.scheduler.stall import DecodeStallPolicy


class Scheduler:
    def __init__(self, prefill_manager: PrefillManager, decode_manager: DecodeManager,
                 interleave_policy: DecodeInterleavePolicy | None = None,
                 stall_policy: DecodeStallPolicy | None = None, mixed_batches: bool = False):
        self.prefill_manager = prefill_manager
        self.decode_manager = decode_manager
        self.interleave_policy = interleave_policy
        self.stall_policy = stall_policy if stall_policy is not None and stall_policy.enabled else None
        self.mixed_batches = mixed_batches  # prefill steps carry one token of every running request
        self._configured: tuple | None = None  # what the knobs allow, kept by the first set_step_limits()
        self.prefill_steps = 0  # mixed steps included
        self.mixed_steps = 0
        self.decode_steps = 0
        self.forced_decode_steps = 0  # decode steps a policy put ahead of prefill (Batch.forced_by)
        self.stall_decode_steps = 0  # ... of which the stall budget asked for

    def set_step_limits(self, prefill_tokens: int, prefill_rows: int, decode_rows: int, mixed: bool) -> None:
        """Steps no bigger than this (the shapes compiled so far), within the configured knobs. Admission follows
        the decode limit, so every running request fits one decode step: a bigger batch waits for its bucket."""
        if self._configured is None:
            self._configured = (self.prefill_manager.max_prefill_tokens, self.prefill_manager.max_prefill_rows,
                                self.decode_manager.max_num_seqs, self.mixed_batches)
        tokens, rows, seqs, mixed_batches = self._configured
        self.prefill_manager.max_prefill_tokens = min(tokens, prefill_tokens)
        self.prefill_manager.max_prefill_rows = min(rows, prefill_rows)
        self.prefill_manager.max_active = self.decode_manager.max_num_seqs = min(seqs, decode_rows)
        self.mixed_batches = mixed_batches and mixed

    @property
    def has_work(self) -> bool:
        return self.prefill_manager.has_work or self.decode_manager.has_work

    def add_request(self, request: Request) -> None:
        self.prefill_manager.add(request)

    def schedule(self) -> Batch | None:
        """The next batch to run, counted in the step statistics."""
        batch = self._schedule_next_batch()
        if batch is None:
            return None
        for request in batch.completed:  # their first decode reads the token this batch samples, on the device
            self.decode_manager.add(request)
        if batch.prefill:
            self.prefill_steps += 1
            self.mixed_steps += bool(batch.decode)
        else:
            self.decode_steps += 1
            self.forced_decode_steps += batch.forced_by is not None
            self.stall_decode_steps += batch.forced_by == "stall"
        return batch

    def _schedule_next_batch(self) -> Batch | None:
        batch = self._decide()
        if batch is not None and self.stall_policy is not None:
            self.stall_policy.note_scheduled(decodes=bool(batch.decode))
        return batch

    def _decide(self) -> Batch | None:
        policy, stall = self.interleave_policy, self.stall_policy
        # Whichever policy is due first wins. Disabled (or absent) policies never want a decode, so the decode
        # manager is not probed here unless one is enabled.
        token_limit = stall.prefill_token_limit(self.prefill_manager.max_prefill_tokens) if stall else None
        due = "interleave" if policy is not None and policy.wants_decode() else "stall" if token_limit == 0 else None
        if due is not None:
            rows = self.decode_manager.schedule_next_rows()
            if rows:
                self._note_decode()
                return Batch(decode=rows, forced_by=due)
            # No decode runnable: fall through to prefill; the streak is kept, so the due state latches.
        riders = self.decode_manager.schedule_next_rows() if self.mixed_batches else ()
        if riders:  # the step's token budget covers the decode rows too
            budget = max(self.prefill_manager.max_prefill_tokens - len(riders), 1)
            token_limit = min(token_limit or budget, budget)
        chunks = self.prefill_manager.schedule_next_chunks(token_limit or None)
        if chunks:
            if riders:
                self._note_decode()
            elif policy is not None:
                policy.note_prefill()
            return Batch(prefill=chunks, decode=riders)
        rows = riders or self.decode_manager.schedule_next_rows()
        if rows:
            self._note_decode()
            return Batch(decode=rows)
        return None

    def _note_decode(self) -> None:
        if self.interleave_policy is not None:
            self.interleave_policy.note_decode()

    def release(self, request: Request) -> None:
        """Free a finished request's pages and slot (each exactly once)."""
        self.prefill_manager.release(request)

    def observe_step(self, batch: Batch, seconds: float) -> None:
        """Step timing for the stall budget's cost model."""
        if self.stall_policy is None:
            return
        if batch.prefill:
            self.stall_policy.observe_prefill(batch.num_tokens, seconds)
        else:
            self.stall_policy.observe_decode(seconds)

    def note_inflight(self, batch: Batch | None, device_start: float | None = None) -> None:
        """The step dispatched and not yet finished when the next one is scheduled (None: nothing in flight), and
        when it started on the device: the stall budget counts its predicted end."""
        if self.stall_policy is None:
            return
        if batch is None:
            self.stall_policy.note_inflight(None)
        else:
            self.stall_policy.note_inflight(device_start + self.stall_policy.predicted_seconds(batch.num_tokens,
                                                                                                bool(batch.prefill)))

    def on_batch_done(self, batch: Batch) -> None:
        """Call after `batch` ran and its tokens were delivered: the stall budget's clocks."""
        if self.stall_policy is None:
            return
        if not self.decode_manager.has_work:
            self.stall_policy.note_idle()
        elif batch.decode:
            self.stall_policy.note_decoded()
        elif any(not request.finished for request in batch.completed):  # a first token: its clock starts
            self.stall_policy.note_runnable()

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None,
               release: bool = True) -> None:
        """End `request` in any state (also an abort, reason "abort"): it is never scheduled again. Its pages and
        slot are freed now, or with release() once no dispatched step still writes them (`release=False`)."""
        self.decode_manager.remove(request)
        self.prefill_manager.remove(request)
        request.mark_finished(reason, stop_reason)
        if release:
            self.release(request)
        if self.stall_policy is not None and not self.decode_manager.has_work:
            self.stall_policy.note_idle()
