"""The real Scheduler._schedule_next_batch driven by call-counting stub managers.

Each step is written as one letter: P (prefill batch), D (decode batch), - (None).
"""

import itertools

import pytest

from jaxserve.request import PrefillChunk, Request
from jaxserve.scheduler import DecodeInterleavePolicy, Scheduler


class StubManager:
    """Returns fresh rows from `make` on every call while `runnable`, else nothing; counts calls. Serves as either
    manager (schedule_next_chunks for prefill, schedule_next_rows for decode)."""

    def __init__(self, make, runnable=True):
        self.make = make
        self.runnable = runnable
        self.calls = 0

    def schedule_next_chunks(self, token_budget=None):
        self.calls += 1
        return self.make() if self.runnable else ()

    schedule_next_rows = schedule_next_chunks


def make_scheduler(every=None, *, policy=True, prefill=True, decode=True):
    """`policy=False` passes no policy object at all; otherwise DecodeInterleavePolicy(every)."""
    prefill_stub = StubManager(lambda: (PrefillChunk(Request("p", [1, 2]), 0, 1),), prefill)
    decode_stub = StubManager(lambda: (Request("d", [1]),), decode)
    interleave = DecodeInterleavePolicy(every) if policy else None
    return Scheduler(prefill_stub, decode_stub, interleave), prefill_stub, decode_stub


def letter(batch):
    return {None: "-", "prefill": "P", "decode": "D"}[batch and batch.phase]


def steps(scheduler, n):
    return "".join(letter(scheduler._schedule_next_batch()) for _ in range(n))


@pytest.mark.parametrize("every, expected", [
    (None, "PPPPPPPPP"),
    (1, "PDPDPDPDP"),
    (3, "PPPDPPPDP"),
    (8, "PPPPPPPPD"),
])
def test_truth_table_with_both_always_runnable(every, expected):
    scheduler, _, _ = make_scheduler(every, policy=every is not None)
    assert steps(scheduler, 9) == expected


def test_every_one_alternates_strictly_starting_with_prefill():
    scheduler, _, _ = make_scheduler(1)
    assert steps(scheduler, 20) == "PD" * 10


def test_due_decode_latches_until_runnable_then_fires_once():
    scheduler, _, decode = make_scheduler(2, decode=False)
    assert steps(scheduler, 2) == "PP"
    assert decode.calls == 0  # not due yet: never probed
    assert steps(scheduler, 3) == "PPP"  # due, but nothing to decode: prefill proceeds
    assert decode.calls == 3  # probed once per due step, no idle step spent
    assert scheduler.interleave_policy.streak == 5  # not reset: the due state latched
    decode.runnable = True
    assert steps(scheduler, 1) == "D"
    assert steps(scheduler, 6) == "PPDPPD"  # the counting restarted from zero


@pytest.mark.parametrize("every", [None, 1, 3])
def test_pure_decode_fallback_when_no_prefill(every):
    scheduler, prefill, decode = make_scheduler(every, policy=every is not None, prefill=False)
    batches = [scheduler.schedule() for _ in range(5)]
    assert "".join(map(letter, batches)) == "DDDDD"
    assert [b.forced_by for b in batches] == [None] * 5  # every decode was the fallback
    assert prefill.calls == 5 and decode.calls == 5
    assert (scheduler.decode_steps, scheduler.forced_decode_steps, scheduler.prefill_steps) == (5, 0, 0)


@pytest.mark.parametrize("every", [None, 2])
def test_no_work_returns_none_and_counts_nothing(every):
    scheduler, prefill, decode = make_scheduler(every, policy=every is not None, prefill=False, decode=False)
    assert [scheduler.schedule() for _ in range(4)] == [None] * 4
    assert prefill.calls == 4 and decode.calls == 4
    assert (scheduler.prefill_steps, scheduler.decode_steps, scheduler.forced_decode_steps) == (0, 0, 0)


@pytest.mark.parametrize("every", [0, -3])
def test_present_but_disabled_policy_behaves_like_none(every):
    disabled, _, _ = make_scheduler(every)
    absent, _, _ = make_scheduler(policy=False)
    assert steps(disabled, 9) == steps(absent, 9) == "PPPPPPPPP"


@pytest.mark.parametrize("every, policy", [(None, False), (None, True), (0, True), (-3, True)])
def test_decode_never_probed_while_prefill_has_work_when_disabled(every, policy):
    scheduler, prefill, decode = make_scheduler(every, policy=policy)
    steps(scheduler, 50)
    assert prefill.calls == 50
    assert decode.calls == 0


def test_797_steps_at_every_8_give_88_decodes_and_no_prefill_run_over_8():
    scheduler, _, _ = make_scheduler(8)
    trace = "".join(letter(scheduler.schedule()) for _ in range(797))
    assert trace.count("D") == 88 == 797 // 9
    assert max(len(list(run)) for key, run in itertools.groupby(trace) if key == "P") == 8
    assert (scheduler.prefill_steps, scheduler.decode_steps, scheduler.forced_decode_steps) == (709, 88, 88)


def test_idle_steps_earn_no_streak_credit():
    scheduler, prefill, decode = make_scheduler(2)
    trace = steps(scheduler, 1)
    prefill.runnable = decode.runnable = False
    trace += steps(scheduler, 5)
    assert scheduler.interleave_policy.streak == 1
    prefill.runnable = decode.runnable = True
    trace += steps(scheduler, 3)
    assert trace == "P-----PDP"


def test_forced_flag_marks_policy_decodes_only():
    scheduler, prefill, _ = make_scheduler(2)
    batches = [scheduler.schedule() for _ in range(3)]  # P P D(forced)
    prefill.runnable = False
    batches.append(scheduler.schedule())  # D (fallback)
    assert [(letter(b), b.forced_by) for b in batches] == [
        ("P", None), ("P", None), ("D", "interleave"), ("D", None)]
    assert (scheduler.prefill_steps, scheduler.decode_steps, scheduler.forced_decode_steps) == (2, 2, 1)


def test_fallback_decode_also_restarts_the_count():
    scheduler, prefill, _ = make_scheduler(2)
    trace = steps(scheduler, 1)
    prefill.runnable = False
    trace += steps(scheduler, 1)  # fallback decode: the streak of 1 is reset
    prefill.runnable = True
    trace += steps(scheduler, 3)
    assert trace == "PDPPD"
