"""The step policies and the one place the scheduling flags become them (docs/scheduling.md).

Each policy is a StepPolicy (scheduler/policy.py); `step_policies` lists the configured ones in the order the
Scheduler asks them: the interleave count, the stall budget (scheduler/stall.py), mixed steps.
"""

from __future__ import annotations

from jaxserve.config import EngineConfig
from jaxserve.request.step import ForcedBy, StepPlan
from jaxserve.scheduler.policy import StepPolicy
from jaxserve.scheduler.stall import DecodeStallPolicy


class DecodeInterleavePolicy(StepPolicy):
    """`--decode-interleave-every N`: after N consecutive prefill steps, take one decode step if one is runnable.

    A pure counter: a decode is due once N prefill-only steps were scheduled since the last step that decoded."""

    forced_by = ForcedBy.INTERLEAVE

    def __init__(self, every: int):
        if every <= 0:
            raise ValueError(f"decode_interleave_every={every}: must be positive (unset: no count)")
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


class MixedSteps(StepPolicy):
    """`--mixed-batches` (the default without an interleave count or a stall budget): every prefill step also carries
    one token of every decoding request, under the pure chunk's token budget (the runner's compiled mixed steps hold
    chunk + decode rows in a pure chunk's tokens)."""

    @property
    def decode_rides_prefill(self) -> bool:
        return True


def step_policies(cfg: EngineConfig, page_size: int, min_chunk_tokens: int) -> list[StepPolicy]:
    """The configured policies, in the order they are asked (whichever is due first wins)."""
    policies: list[StepPolicy] = []
    if cfg.interleave_every is not None:
        policies.append(DecodeInterleavePolicy(cfg.interleave_every))
    if cfg.stall_budget_ms is not None:
        policies.append(DecodeStallPolicy(cfg.stall_budget_ms, page_size=page_size, min_chunk_tokens=min_chunk_tokens))
    if cfg.mixed_steps:
        policies.append(MixedSteps())
    return policies
