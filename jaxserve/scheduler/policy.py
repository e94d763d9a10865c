"""The step-policy interface: one rule about which step comes next (docs/scheduling.md; the policies are in
scheduler/policies.py and scheduler/stall.py).

The Scheduler asks each of its policies, in order, before every step and tells each what it scheduled and how
that step went. A scheduler with no policy is prefill-first; policies compose (whichever is due first wins).

A policy a flag turns on registers itself (`register_step_policy`) with its name, its option (the
`EngineConfig.step_policies` key, whose flag the CLI adds) and how the option's value builds it: the flag, the
config's check, the scheduler's wiring, the metric and the log lines of the decodes it forces all follow from that
registration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jaxserve.config import STEP_POLICIES, Flag
from jaxserve.request.step import StepPlan


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may need from the engine besides its option's value."""

    page_size: int  # a chunk a policy shortens stays page-aligned
    min_chunk_tokens: int  # the smallest compiled chunk: no shorter prefill step runs


class StepPolicy:
    """The hooks a policy may implement; the defaults never intervene."""

    # What a decode this policy puts ahead of prefill is marked with (StepPlan.forced_by), its metric's prefix
    # (`<name>_decode_steps`) and its registered name.
    name: ClassVar[str] = ""

    # Registered policies only: the option that turns the policy on (an EngineConfig.step_policies key; the CLI's
    # flag is its name with dashes), its flag, what the stats line and the metric call the decodes it forced.
    option: ClassVar[str]
    flag: ClassVar[Flag]
    forced_words: ClassVar[str]  # "{n} interleaved"
    metric_help: ClassVar[str]

    @classmethod
    def from_option(cls, value: float, context: PolicyContext) -> StepPolicy:
        """The policy its option's positive `value` asks for."""
        raise NotImplementedError(f"{cls.__name__} has no option")

    def describe(self) -> str:
        """Why a decode it forced ran, for the engine's log ("interleaved after 8 prefill steps")."""
        return self.name

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


def register_step_policy(cls: type[StepPolicy]) -> type[StepPolicy]:
    """Class decorator: `cls` is a step policy its option turns on, registered under its name."""
    return STEP_POLICIES.register(cls.name)(cls)
