"""`--decode-interleave-every N`: after N consecutive prefill steps, take one decode step if one is runnable.

A pure counter (no engine, no device), semantics as in docs/scheduling.md: the scheduler reports every step it
schedules; a decode is due once N prefill-only steps ran since the last step that decoded.
"""

from __future__ import annotations

from jaxserve.scheduler.policy import StepPolicy
from jaxserve.step import ForcedBy, StepPlan


class DecodeInterleavePolicy(StepPolicy):
    forced_by = ForcedBy.INTERLEAVE

    def __init__(self, every: int):
        if every <= 0:
            raise ValueError(f"decode_interleave_every={every}: must be positive (unset: prefill-first)")
        self.every = every
        self._streak = 0  # prefill-only steps scheduled since the last step that decoded

    @property
    def streak(self) -> int:
        return self._streak

    def prefill_token_limit(self, budget: int) -> int:
        # While a due decode has no runnable request the streak keeps growing past `every`: the due state latches.
        return 0 if self._streak >= self.every else budget

    def on_scheduled(self, plan: StepPlan) -> None:
        # Only scheduled steps count (idle iterations earn no credit); any step that decodes (a forced or fallback
        # decode, a mixed step) resets the streak.
        self._streak = 0 if plan.decode else self._streak + 1
