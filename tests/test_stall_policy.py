"""`--max-decode-stall-ms` through the real Scheduler with stub managers and a fake clock."""

from __future__ import annotations

import pytest

from jaxserve.config import EngineConfig
from jaxserve.request import Request
from jaxserve.request.step import StepKind, StepRow
from jaxserve.scheduler import (
    DecodeInterleavePolicy,
    DecodeStallPolicy,
    MixedSteps,
    PolicyContext,
    Scheduler,
    step_policies,
)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class StubPrefill:
    max_prefill_tokens, max_prefill_rows = 256, 1

    def __init__(self):
        self.budgets = []

    def schedule_next_chunks(self, token_budget, max_rows, max_active):
        self.budgets.append(token_budget)
        return (StepRow.chunk(Request("p", [1, 2]), 0, 1),)


class StubDecode:
    max_num_seqs = 4

    def __init__(self, runnable=True):
        self.runnable = runnable
        self.calls = 0

    has_work = property(lambda self: self.runnable)

    def schedule_next_rows(self, max_rows):
        self.calls += 1
        return (StepRow.next_token(Request("d", [1])),) if self.runnable else ()


def make(stall_ms, every=None, adaptive=True, decode_runnable=True):
    clock = FakeClock()
    stall = DecodeStallPolicy(stall_ms, page_size=16, min_chunk_tokens=64, adaptive_chunks=adaptive, clock=clock)
    prefill, decode = StubPrefill(), StubDecode(decode_runnable)
    scheduler = Scheduler(prefill, decode, ([] if every is None else [DecodeInterleavePolicy(every)]) + [stall])
    return scheduler, stall, prefill, decode, clock


def warm(stall, per_token_s=0.001, decode_s=0.010):
    stall.observe_prefill(100, 100 * per_token_s)
    stall.observe_decode(decode_s)


def letter(plan):
    return "-" if plan is None else {StepKind.PREFILL: "P", StepKind.DECODE: "D"}[plan.kind]


def test_chunk_shrinks_to_fit_and_the_inflight_step_counts():
    scheduler, stall, prefill, _, clock = make(100)
    warm(stall)
    stall.note_decoded()  # decodes wait from t=0
    # 100 ms budget - 10 ms decode = 90 tokens at 1 ms each -> 80 page-aligned.
    assert letter(scheduler.schedule()) == "P" and prefill.budgets[-1] == 80
    stall.observe_prefill(80, 0.080)  # that step ran (still 1 ms per token)
    # With a step in flight until t=50 ms only 40 tokens fit -> 32 aligned, under the 64-token floor: decode.
    stall.note_inflight(0.050)
    batch = scheduler.schedule()
    assert letter(batch) == "D" and batch.forced_by == "stall"
    assert scheduler.counts.forced["stall"] == scheduler.counts.forced_total == 1


def test_full_chunks_while_the_budget_allows_and_a_decode_when_it_does_not():
    scheduler, stall, prefill, _, clock = make(400, adaptive=False)
    stall.note_decoded()
    warm(stall)  # a prefill step ran since the last decode
    assert letter(scheduler.schedule()) == "P" and prefill.budgets[-1] == 256  # 256 + 10 ms < 400 ms
    clock.now = 0.2  # 200 ms already waited: a 256 ms step would break the budget
    assert letter(scheduler.schedule()) == "D"
    stall.note_decoded()  # the decode ran: the clock restarts, and the next step prefills at full size
    assert letter(scheduler.schedule()) == "P" and prefill.budgets[-1] == 256


def test_a_budget_tighter_than_any_step_slows_prefill_but_never_stops_it():
    scheduler, stall, prefill, _, clock = make(1)  # 1 ms: less than one decode step
    warm(stall)
    stall.note_scheduled(decodes=True)  # the last step decoded...
    stall.note_decoded()  # ... and has run
    pattern = ""
    for _ in range(8):
        batch = scheduler.schedule()
        pattern += letter(batch)
        clock.now += 0.05
        if batch.kind is StepKind.DECODE:
            stall.note_decoded()
        else:
            stall.observe_prefill(prefill.budgets[-1], 0.064)
    assert pattern == "PDPDPDPD"  # the floor chunk after every decode: no decode ever follows a decode
    assert set(prefill.budgets) == {64}


def test_with_a_step_in_flight_the_floor_still_follows_every_decode():
    """Overlap scheduling: each decision is made while the step before it still runs, so the policy hears of a
    step's end one decision late. The decision itself records what it scheduled: prefill is never stopped."""
    scheduler, stall, prefill, _, clock = make(1)
    warm(stall)
    stall.note_decoded()
    pattern, inflight = "", None
    for _ in range(8):
        if inflight is not None:
            stall.note_inflight(clock.now + 0.05)
        batch = scheduler.schedule()
        pattern += letter(batch)
        clock.now += 0.05
        if inflight is not None:  # the step before this one ends only now
            if inflight.kind is StepKind.DECODE:
                stall.note_decoded()
            else:
                stall.observe_prefill(64, 0.064)
        inflight = batch
    assert "DD" not in pattern and pattern.count("P") >= 4 and set(prefill.budgets) == {64}


def test_fresh_arrivals_are_exempt():
    scheduler, stall, prefill, _, clock = make(100)
    warm(stall)
    clock.now = 30.0  # a long prefill ran while nobody was decoding
    assert letter(scheduler.schedule()) == "P" and prefill.budgets[-1] == 256
    stall.note_runnable()  # the first token just arrived: its stall clock starts now, not at its arrival
    stall.observe_prefill(100, 0.1)
    assert letter(scheduler.schedule()) == "P" and prefill.budgets[-1] == 80
    clock.now = 30.05
    stall.note_runnable()  # a second newcomer does not restart the first one's clock
    assert letter(scheduler.schedule()) == "D"


def test_before_any_measurement_prefill_proceeds():
    scheduler, stall, prefill, _, _ = make(1)
    stall.note_decoded()
    assert letter(scheduler.schedule()) == "P" and prefill.budgets[-1] == 256


def test_composes_with_the_count_policy_whichever_is_due_first():
    # A generous budget: the count policy decides.
    scheduler, stall, _, _, _ = make(10_000, every=3)
    stall.note_decoded()
    warm(stall)  # a prefill step ran since the last decode
    assert "".join(letter(scheduler.schedule()) for _ in range(8)) == "PPPDPPPD"
    assert scheduler.counts.forced_total == 2 and scheduler.counts.forced["stall"] == 0
    # A tight budget fires before the count does.
    scheduler, stall, _, _, clock = make(100, every=8, adaptive=False)
    stall.note_decoded()
    warm(stall)  # a prefill step ran since the last decode
    clock.now = 0.05
    batch = scheduler.schedule()
    assert letter(batch) == "D" and batch.forced_by == "stall"


@pytest.mark.parametrize("stall_ms", [None, 0, -5])
def test_a_budget_that_asks_for_nothing_makes_no_policy(stall_ms):
    cfg = EngineConfig(step_policies={"max_decode_stall_ms": stall_ms, "decode_interleave_every": 3})
    policies = step_policies(cfg, PolicyContext(page_size=16, min_chunk_tokens=64))
    assert [type(p) for p in policies] == [DecodeInterleavePolicy]
    prefill = StubPrefill()
    scheduler = Scheduler(prefill, StubDecode(), policies)
    assert "".join(letter(scheduler.schedule()) for _ in range(9)) == "PPPDPPPDP"
    assert prefill.budgets == [256] * 7
    if stall_ms is not None:
        with pytest.raises(ValueError, match="max_decode_stall_ms"):
            DecodeStallPolicy(stall_ms)


def test_due_but_nothing_to_decode_prefills_at_full_budget():
    scheduler, stall, prefill, decode, clock = make(100, decode_runnable=False)
    stall.note_decoded()
    warm(stall)  # a prefill step ran since the last decode
    clock.now = 5.0
    assert letter(scheduler.schedule()) == "P"
    assert decode.calls == 1 and prefill.budgets[-1] == 256  # no slot spent idle to keep the promise


def test_with_mixed_steps_the_decode_rows_come_out_of_the_stall_budgets_chunk_too():
    """A limit the stall budget sets is a step's tokens, decode rows included: the chunk is cut by the mixed step's
    decode rows (4 here), so chunk + decode rows fits the mixed shape of the bucket the limit names (a page-aligned
    80-token limit as an 80-token chunk would need the next, much bigger bucket)."""
    clock = FakeClock()
    stall = DecodeStallPolicy(100, page_size=16, min_chunk_tokens=64, clock=clock)
    prefill = StubPrefill()
    scheduler = Scheduler(prefill, StubDecode(), [stall, MixedSteps()])
    warm(stall)
    stall.note_decoded()
    plan = scheduler.schedule()
    assert plan.kind is StepKind.MIXED and prefill.budgets[-1] == 80 - StubDecode.max_num_seqs


@pytest.mark.parametrize("inflight_decodes, budget", [(False, 32), (True, 256)])
def test_a_step_in_flight_that_decodes_restarts_the_wait_at_its_end(inflight_decodes, budget):
    """Mixed steps under a stall budget: the step in flight carries the decode rows, so every running request gets a
    token when it ends and the next chunk has the whole budget from there. Counted from the token before it, the
    next chunk would be cut for a wait that the step in flight ends (the stall row's chunks shrank with mixing on)."""
    clock = FakeClock()
    stall = DecodeStallPolicy(300, page_size=16, min_chunk_tokens=16, clock=clock)
    prefill = StubPrefill()
    scheduler = Scheduler(prefill, StubDecode(), [stall, MixedSteps()])
    warm(stall)  # 1 ms per prompt token, 10 ms per decode step
    stall.note_decoded()  # the last token came at t=0
    clock.now = 0.01
    stall.note_inflight(0.25, decodes=inflight_decodes)  # a 240-token step in flight, ending at t=250 ms
    plan = scheduler.schedule()
    # Waiting since t=0: 300 - 250 - 10 ms decode leave 40 tokens, 32 page-aligned. Waiting since t=250 ms: 300 - 10
    # ms leave 290 tokens, more than a pure chunk's 256. The mixed step's 4 decode rows come out of either.
    assert plan.kind is StepKind.MIXED and prefill.budgets[-1] == budget - StubDecode.max_num_seqs


@pytest.mark.parametrize(
    "steps, expected",
    [
        # One size seen: no fixed cost can be told apart, seconds per token through the origin (37.5 ms / 8 tokens
        # predict 4.7 ms a token: 90 ms fit 19 tokens, under the 64-token floor): a decode first, the safe side.
        ([(8, 0.0375)], ("D", None)),
        # Two sizes: 35 ms fixed + 0.3 ms a token. 90 ms fit (90 - 35) / 0.3 = 183 tokens, 176 page-aligned (seconds
        # per token averaged over both steps would have fit 24 tokens: a decode).
        ([(8, 0.0374), (40, 0.047)], ("P", 176)),
        # Only full chunks: per token through the origin, as before (0.4 ms a token: 225 tokens, 224 aligned).
        ([(256, 0.1024)] * 3, ("P", 224)),
    ],
)
def test_a_prefill_steps_fixed_cost_is_learned_apart_from_its_cost_per_token(steps, expected):
    """A short prompt's step is mostly fixed cost (weights, launch): seconds per token measured on it made a long
    prompt's next chunks look many times dearer than they are, and the stall budget cut them for nothing."""
    scheduler, stall, prefill, _, clock = make(100)
    for tokens, seconds in steps:
        stall.observe_prefill(tokens, seconds)
    stall.observe_decode(0.010)
    stall.note_decoded()  # decodes wait from t=0: 100 ms - 10 ms decode leave 90 ms of prefill
    plan = scheduler.schedule()
    assert (letter(plan), prefill.budgets[-1] if plan.kind is StepKind.PREFILL else None) == expected
