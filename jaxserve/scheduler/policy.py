"""The step-policy interface: one rule about which step comes next (docs/scheduling.md; the policies are in
scheduler/policies.py and scheduler/stall.py).

The Scheduler asks each of its policies, in order, before every step and tells each what it scheduled and how
that step went. A scheduler with no policy is prefill-first; policies compose (whichever is due first wins).
"""

from __future__ import annotations

from jaxserve.request.step import ForcedBy, StepPlan


class StepPolicy:
    """The hooks a policy may implement; the defaults never intervene."""

    forced_by: ForcedBy | None = None  # what a decode this policy puts ahead of prefill is marked with

    def prefill_token_limit(self, budget: int) -> int:
        """How many prompt tokens the next step may carry, of `budget`; 0: a decode step is due first (when none is
        runnable the step prefills anyway, and the policy keeps asking)."""
        return budget

    @property
    def decode_rides_prefill(self) -> bool:
        """Whether a prefill step also carries one token of every decoding request (a mixed step)."""
        return False

    def on_scheduled(self, plan: StepPlan) -> None:
        """`plan` was scheduled (it may still be in flight when the next step is scheduled)."""

    def on_inflight(self, plan: StepPlan | None, device_start: float | None) -> None:
        """The step dispatched and not yet finished as the next one is scheduled (None: nothing in flight), and when
        it started (or will start) on the device."""

    def on_step_done(self, plan: StepPlan, seconds: float, decoding: bool) -> None:
        """`plan` ran in `seconds` and its tokens were delivered; `decoding`: some request is still decoding."""

    def on_nothing_decoding(self) -> None:
        """The last decoding request finished."""
