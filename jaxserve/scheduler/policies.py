"""The step policies and the one place the scheduling flags become them (docs/scheduling.md).

Each policy is a StepPolicy (scheduler/policy.py); those a flag turns on register themselves here
(`register_step_policy`: the interleave count; the stall budget, scheduler/stall.py, imported here so that it
registers too). `step_policies` lists the configured ones in the order the Scheduler asks them: the registered ones by
name, then mixed steps.
"""

from __future__ import annotations

from jaxserve.config import EngineConfig, Flag, step_policy_options
from jaxserve.request.step import StepPlan
from jaxserve.scheduler.policy import PolicyContext, StepPolicy, register_step_policy
from jaxserve.scheduler.stall import DecodeStallPolicy

__all__ = ["DecodeInterleavePolicy", "DecodeStallPolicy", "MixedSteps", "step_policies"]


@register_step_policy
class DecodeInterleavePolicy(StepPolicy):
    """`--decode-interleave-every N`: after N consecutive prefill steps, take one decode step if one is runnable.

    A pure counter: a decode is due once N prefill-only steps were scheduled since the last step that decoded."""

    name = "interleave"
    option = "decode_interleave_every"
    flag = Flag(
        int,
        "After N consecutive prefill steps, take one decode step (when a request is decoding) before prefilling "
        "further. Smaller N: running requests wait less for their next token, but new prompts take longer to reach "
        "their first token; larger N: the reverse. Under asynchronous dispatch the longest wait for the next token of "
        "a running request is about (N+1) x t_chunk + t_decode (t_chunk: one prefill step of --chunked-prefill-size "
        "tokens, t_decode: one decode step). Setting it turns the default mixed steps off (see --mixed-batches). Unset "
        "or 0: no count.",
    )
    forced_words = "interleaved"
    metric_help = "Decode steps --decode-interleave-every asked for."

    def __init__(self, every: int):
        if every <= 0:
            raise ValueError(f"decode_interleave_every={every}: must be positive (unset: no count)")
        self.every = every
        self._streak = 0  # prefill-only steps scheduled since the last step that decoded

    @classmethod
    def from_option(cls, value: float, context: PolicyContext) -> StepPolicy:
        return cls(int(value))

    def describe(self) -> str:
        return f"interleaved after {self.every} prefill steps"

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

    name = "mixed"

    @property
    def decode_rides_prefill(self) -> bool:
        return True


def step_policies(cfg: EngineConfig, context: PolicyContext) -> list[StepPolicy]:
    """The configured policies, in the order they are asked (whichever is due first wins)."""
    by_option = step_policy_options()
    policies = [by_option[option].from_option(value, context) for option, value in cfg.active_step_policies.items()]
    if cfg.mixed_steps:
        policies.append(MixedSteps())
    return policies
