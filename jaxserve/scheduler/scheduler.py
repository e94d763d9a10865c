"""The per-iteration decision: a prefill step, a decode step, a mixed step, or nothing (docs/scheduling.md).

Request life and the prefill -> decode hand-off (driven by the engine loop):
  add_request -> PrefillManager queue (WAITING) -> admitted, chunks scheduled (PREFILLING)
  -> the step holding its last chunk is scheduled: the request joins the DecodeManager (DECODING) at once
  -> that step runs and samples the first output token; the engine delivers it and runs the stop checks
  -> finish(request, reason) at EOS / stop / max_tokens / error (FINISHED) or abort (ABORTED): out of both
     managers, pages and slot freed.
The hand-off does not wait for the step to have run: a decode row's input is the token its slot sampled last,
which stays on the device, so with a step in flight the first decode can be the very next step. A request that
stops on its first token (or is aborted meanwhile) may have had one decode row computed: never delivered.

Disaggregated serving (docs/architecture.md): a prefill server's request (`hand_off_from`) never joins decoding, the
engine finishes it after its first token; a decode server's remote request is admitted by `admit_remote` (PREFILLING
while its state is on its way) and joins decoding when it arrives (`arrived`), its first token already sampled.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from jaxserve.request import FinishReason, Request
from jaxserve.request.step import MIXED_PREFILL_ROWS, StepKind, StepLimits, StepPlan
from jaxserve.scheduler.decode import DecodeManager
from jaxserve.scheduler.policy import StepPolicy
from jaxserve.scheduler.prefill import PrefillManager


@dataclasses.dataclass
class StepCounts:
    """Steps scheduled, by kind, and the decode steps each policy put ahead of prefill (by its name)."""

    by_kind: collections.Counter[StepKind] = dataclasses.field(default_factory=collections.Counter)
    forced: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def copy(self) -> StepCounts:
        return StepCounts(collections.Counter(self.by_kind), collections.Counter(self.forced))

    @property
    def prefill(self) -> int:
        """Steps that prefilled, mixed ones included."""
        return self.by_kind[StepKind.PREFILL] + self.by_kind[StepKind.MIXED]

    @property
    def mixed(self) -> int:
        return self.by_kind[StepKind.MIXED]

    @property
    def decode(self) -> int:
        """Decode-only steps, forced or not."""
        return self.by_kind[StepKind.DECODE]

    @property
    def forced_total(self) -> int:
        return sum(self.forced.values())


class Scheduler:
    def __init__(
        self, prefill_manager: PrefillManager, decode_manager: DecodeManager, policies: Sequence[StepPolicy] = ()
    ):
        self.prefill_manager = prefill_manager
        self.decode_manager = decode_manager
        self.policies = tuple(policies)  # asked in order: whichever is due first wins
        self.counts = StepCounts()
        self._compiled: StepLimits | None = None  # what the compiled shapes allow (None: no limit known)

    def policy_named(self, name: str) -> StepPolicy:
        """The policy a plan's `forced_by` names."""
        return next(policy for policy in self.policies if policy.name == name)

    def set_step_limits(self, compiled: StepLimits) -> None:
        """Steps no bigger than the shapes compiled so far (within the configured knobs, which stay as they are).
        Admission follows the decode limit, so every running request fits one decode step: a bigger batch waits
        for its shape."""
        self._compiled = compiled

    def limits(self) -> StepLimits:
        """What the next step may carry: the configured knobs within the compiled shapes."""
        pm, dm, compiled = self.prefill_manager, self.decode_manager, self._compiled
        configured = StepLimits(
            pm.max_prefill_tokens, pm.max_prefill_rows, dm.max_num_seqs, mixed_decode_rows=dm.max_num_seqs
        )
        if compiled is None:
            return configured
        return StepLimits(
            min(configured.prefill_tokens, compiled.prefill_tokens),
            min(configured.prefill_rows, compiled.prefill_rows),
            min(configured.decode_rows, compiled.decode_rows),
            compiled.mixed_decode_rows,
            compiled.decode_row_tokens,
        )

    @property
    def has_work(self) -> bool:
        return self.prefill_manager.has_work or self.decode_manager.has_work

    def add_request(self, request: Request) -> None:
        self.prefill_manager.add(request)

    def schedule(self) -> StepPlan | None:
        """The next step to run. Scheduling is the commitment: prompts it completes join decoding now (their first
        decode reads the token this step samples, on the device), and every request it samples a token for counts
        it (`num_sampled`), so the next decode row's position follows it."""
        plan = self._decide()
        if plan is None:
            return None
        for request in plan.completed:
            if request.hand_off_from is None:  # a request handed off after its first token never decodes here
                self.decode_manager.add(request)
        for request in plan.completed + [row.request for row in plan.decode]:
            request.num_sampled += 1
        self.counts.by_kind[plan.kind] += 1
        if plan.forced_by is not None:
            self.counts.forced[plan.forced_by] += 1
        for policy in self.policies:
            policy.on_scheduled(plan)
        return plan

    def _decide(self) -> StepPlan | None:
        limits = self.limits()
        budget, due = limits.prefill_tokens, None
        for policy in self.policies:
            allowed = policy.prefill_token_limit(limits.prefill_tokens)
            if allowed == 0:
                due = due or policy  # the first policy due names the decode it forces
            else:
                budget = min(budget, allowed)
        if due is not None:
            rows = self.decode_manager.schedule_next_rows(limits.decode_rows)
            if rows:
                return StepPlan(decode=rows, forced_by=due.name)
            # No decode runnable: prefill instead; the policy stays due, so a decode comes as soon as one can.
        mixed = limits.mixed and any(policy.decode_rides_prefill for policy in self.policies)
        riders = self.decode_manager.schedule_next_rows(limits.decode_rows) if mixed else ()
        max_rows = limits.prefill_rows
        if riders:
            # One chunk, and the decode rows take their share of the step's tokens (k + 1 a row verifying k drafts),
            # whoever set them (the pure chunk or a policy's limit): chunk + the rows' tokens then fits the mixed shape
            # of the bucket that limit names.
            budget, max_rows = max(budget - limits.mixed_decode_tokens, 1), MIXED_PREFILL_ROWS
        chunks = self.prefill_manager.schedule_next_chunks(budget, max_rows, limits.decode_rows)
        if chunks:
            return StepPlan(prefill=chunks, decode=riders)
        rows = riders or self.decode_manager.schedule_next_rows(limits.decode_rows)
        return StepPlan(decode=rows) if rows else None

    def admit_remote(self) -> list[Request]:
        """Admit the remote requests that fit now (a decode server's: their state comes from a prefill server)."""
        return self.prefill_manager.admit_remote(self.limits().decode_rows)

    def arrived(self, request: Request) -> None:
        """A remote request's state and first token are on the device: it decodes from its second token on."""
        self.prefill_manager.arrived(request)
        self.decode_manager.add(request)
        request.num_sampled = 1

    def note_accepted(self, request: Request, accepted: int) -> None:
        """A verify row of `request` kept `accepted` drafts before the token scheduling counted: they are sampled
        tokens too (its next row starts after them)."""
        request.num_sampled += accepted

    def release(self, request: Request) -> None:
        """Free a finished request's pages and slot (each exactly once)."""
        self.prefill_manager.release(request)

    def note_inflight(self, plan: StepPlan | None, device_start: float | None = None) -> None:
        """The step dispatched and not yet finished as the next one is scheduled (None: nothing in flight), and when
        it started on the device."""
        for policy in self.policies:
            policy.on_inflight(plan, device_start)

    def on_step_done(self, plan: StepPlan, seconds: float) -> None:
        """Call after `plan` ran and its tokens were delivered."""
        for policy in self.policies:
            policy.on_step_done(plan, seconds, self.decode_manager.has_work)

    def finish(
        self, request: Request, reason: FinishReason, stop_reason: int | str | None = None, release: bool = True
    ) -> None:
        """End `request` in any state (an abort: reason "abort"): it is never scheduled again. Its pages and slot
        are freed now, or with release() once no dispatched step still writes them (`release=False`)."""
        self.decode_manager.remove(request)
        self.prefill_manager.remove(request)
        request.mark_finished(reason, stop_reason)
        if release:
            self.release(request)
        if not self.decode_manager.has_work:
            for policy in self.policies:
                policy.on_nothing_decoding()
