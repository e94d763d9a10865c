"""`--max-decode-stall-ms T`: prefill keeps priority, but a runnable decode never waits longer than T.

A pure object with an injected clock. It predicts the next prefill step's cost from the prefill steps measured so
far, as a fixed cost plus a cost per token (`PrefillCost`: a least-squares fit in which older steps weigh less, so it
adapts as it runs), and counts the step already in flight.
When the next prefill step would break the budget it either shrinks that step (adaptive chunking: the largest
page-aligned token count that still fits, if at least `min_chunk_tokens`) or asks for a decode step.

The stall clock of a request starts at its latest token: a fresh arrival's prefill time is not a decode
stall, so a request that has just produced its first token does not trigger a decode by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from jaxserve.config import Flag
from jaxserve.request.step import StepPlan
from jaxserve.scheduler.policy import PolicyContext, StepPolicy, register_step_policy


class PrefillCost:
    """A prefill step's seconds as `fixed + per_token * tokens`, fitted by least squares over the steps observed,
    each older step weighing `1 - forgetting` times less. A step has a fixed cost (weights read once, launch), so
    seconds per token measured on a short prompt's step would make a long prompt's chunk look many times dearer than
    it is. Until the steps seen differ enough in size to tell the two costs apart, the fit has no fixed part (seconds
    per token, through the origin), which overestimates long steps after short ones: the safe side of a stall budget.
    """

    def __init__(self, forgetting: float):
        self.forgetting = forgetting
        # Weighted sums of 1, n, n^2, t and n*t over the observed steps (n tokens, t seconds).
        self.w = self.n = self.nn = self.t = self.nt = 0.0
        self.fixed_s = self.per_token_s = 0.0  # the fit, refitted at each observation

    @property
    def known(self) -> bool:
        return self.nn > 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        keep = 1 - self.forgetting
        self.w = keep * self.w + 1
        self.n = keep * self.n + num_tokens
        self.nn = keep * self.nn + num_tokens * num_tokens
        self.t = keep * self.t + seconds
        self.nt = keep * self.nt + num_tokens * seconds
        self.fixed_s, self.per_token_s = self._fit()

    def _fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token) from the sums."""
        spread = self.w * self.nn - self.n * self.n  # the sizes' weighted variance, times w^2
        if spread > 0.01 * self.w * self.nn:  # sizes differ by more than ~10% (std/rms): both costs are identifiable
            per_token = (self.w * self.nt - self.n * self.t) / spread
            fixed = (self.t - per_token * self.n) / self.w
            if per_token > 0 and fixed >= 0:
                return fixed, per_token
        return 0.0, self.nt / self.nn

    def seconds(self, num_tokens: int) -> float:
        """0 before any observation."""
        return self.fixed_s + self.per_token_s * num_tokens

    def tokens_within(self, seconds: float) -> int:
        """The most tokens one step may carry to take at most `seconds` (0 when not even the fixed cost fits)."""
        if seconds <= self.fixed_s or self.per_token_s <= 0:
            return 0
        return int((seconds - self.fixed_s) / self.per_token_s)


@register_step_policy
class DecodeStallPolicy(StepPolicy):
    name = "stall"
    option = "max_decode_stall_ms"
    flag = Flag(
        float,
        "Keep prefill's priority, but never let a running request wait longer than this many milliseconds for its "
        "next token: the engine learns the per-token prefill cost, counts the step in flight, and shrinks the next "
        "chunk (page-aligned, with a floor) or takes a decode step when the next prefill step would break the budget. "
        "Requests still waiting for their first token are not held back. Composes with --decode-interleave-every "
        "(whichever is due first wins).",
        metavar="MS",
    )
    forced_words = "for the stall budget"
    metric_help = "Decode steps the --max-decode-stall-ms budget asked for."

    def __init__(
        self,
        max_stall_ms: float,
        *,
        page_size: int = 1,
        min_chunk_tokens: int = 64,
        adaptive_chunks: bool = True,
        clock: Callable[[], float] = time.monotonic,
        smoothing: float = 0.3,
    ):
        if max_stall_ms <= 0:
            raise ValueError(f"max_decode_stall_ms={max_stall_ms}: must be positive (unset: no stall budget)")
        self.budget_s = max_stall_ms / 1000.0
        self.page_size = page_size
        self.min_chunk_tokens = max(min_chunk_tokens, page_size)
        self.adaptive_chunks = adaptive_chunks
        self.clock = clock
        self.smoothing = smoothing
        self.prefill_cost = PrefillCost(forgetting=smoothing)  # learned
        self.decode_step_s: float = 0.0  # learned
        self.waiting_since: float | None = None  # oldest latest-token time among runnable decodes
        self.inflight_until: float | None = None  # predicted end of a step already dispatched
        self.inflight_decodes = False  # whether that step gives every runnable request a token (decode or mixed)
        # After a decode step, the next step may always prefill at least the floor: a budget tighter than one step
        # must slow prefill down, never stop it (a request that never prefills never starts).
        self.prefill_owed = False

    @classmethod
    def from_option(cls, value: float, context: PolicyContext) -> StepPolicy:
        return cls(value, page_size=context.page_size, min_chunk_tokens=context.min_chunk_tokens)

    def describe(self) -> str:
        return f"stall budget {self.budget_s * 1000:g} ms"

    # ---- the StepPolicy hooks -------------------------------------------------------------------------------
    def on_scheduled(self, plan: StepPlan) -> None:
        self.note_scheduled(decodes=bool(plan.decode))

    def on_inflight(self, plan: StepPlan | None, device_start: float | None) -> None:
        if plan is None or device_start is None:
            self.note_inflight(None)
        else:
            predicted_end = device_start + self.predicted_seconds(plan.num_tokens, bool(plan.prefill))
            self.note_inflight(predicted_end, decodes=bool(plan.decode))

    def on_step_done(self, plan: StepPlan, seconds: float, decoding: bool) -> None:
        if plan.prefill:
            self.observe_prefill(plan.num_tokens, seconds)
        else:
            self.observe_decode(seconds)
        if not decoding:
            self.note_idle()
        elif plan.decode:
            self.note_decoded()
        elif any(not request.finished for request in plan.completed):  # a first token: its clock starts
            self.note_runnable()

    def on_nothing_decoding(self) -> None:
        self.note_idle()

    # ---- observations --------------------------------------------------------------------------------------
    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            self.prefill_cost.observe(num_tokens, seconds)

    def observe_decode(self, seconds: float) -> None:
        self.decode_step_s = self._smooth(self.decode_step_s or None, seconds)

    def note_decoded(self) -> None:
        """Every runnable request just got a token."""
        self.waiting_since = self.clock()

    def note_scheduled(self, decodes: bool) -> None:
        """A step was scheduled (it may still be in flight when the next one is): after one that decodes, the next
        may always prefill at least the floor."""
        self.prefill_owed = decodes

    def note_runnable(self) -> None:
        """A request just produced its first token; older waiters keep their (earlier) start."""
        if self.waiting_since is None:
            self.waiting_since = self.clock()

    def note_idle(self) -> None:
        """Nothing is running: nobody is waiting for a token."""
        self.waiting_since = None

    def predicted_seconds(self, num_tokens: int, prefill: bool) -> float:
        """What a step is expected to take, from what was measured so far (0 before anything was)."""
        return self.prefill_cost.seconds(num_tokens) if prefill else self.decode_step_s

    def note_inflight(self, predicted_end: float | None, decodes: bool = False) -> None:
        """A step is dispatched and will end around `predicted_end` (None: nothing in flight); `decodes`: it carries
        a token of every runnable request (a decode step, or a mixed step's decode rows)."""
        self.inflight_until = predicted_end
        self.inflight_decodes = decodes and predicted_end is not None

    # ---- decisions -----------------------------------------------------------------------------------------
    def prefill_token_limit(self, budget_tokens: int) -> int:
        """How many prefill tokens the next step may carry: `budget_tokens` when nobody waits or nothing is
        known yet, fewer to fit the stall budget, or 0 when a decode must come first."""
        if self.waiting_since is None or not self.prefill_cost.known:
            return budget_tokens
        now = self.clock()
        start = max(now, self.inflight_until or now)  # the next step starts after the one in flight
        # A step in flight that decodes ends every wait at its end: the next step's budget starts there.
        wait_from = start if self.inflight_decodes else self.waiting_since
        slack = wait_from + self.budget_s - start - self.decode_step_s
        fits = self.prefill_cost.tokens_within(slack)
        if fits >= budget_tokens:
            return budget_tokens
        aligned = fits - fits % self.page_size
        if self.prefill_owed:
            return max(aligned, self.min_chunk_tokens) if self.adaptive_chunks else budget_tokens
        if not self.adaptive_chunks:
            return 0
        return aligned if aligned >= self.min_chunk_tokens else 0

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new
