"""The real Scheduler driven by call-counting stub managers: the decision, as a truth table of step letters.

Each step is written as one letter: P (prefill step), D (decode step), M (mixed step), - (None).
"""

import itertools

import pytest

from jaxserve.request import Request
from jaxserve.request.step import StepKind, StepLimits, StepRow
from jaxserve.scheduler import DecodeInterleavePolicy, MixedSteps, Scheduler


class StubManager:
    """Returns fresh rows from `make` on every call while `runnable`, else nothing; counts calls and keeps the limits
    it was called with. Serves as either manager (schedule_next_chunks for prefill, schedule_next_rows for decode)."""

    max_prefill_tokens, max_prefill_rows, max_num_seqs = 256, 1, 4

    def __init__(self, make, runnable=True):
        self.make = make
        self.runnable = runnable
        self.calls = 0
        self.budgets = []

    @property
    def has_work(self):
        return self.runnable

    def schedule_next_chunks(self, token_budget, max_rows=1, max_active=1):
        self.calls += 1
        self.budgets.append(token_budget)
        return self.make() if self.runnable else ()

    schedule_next_rows = schedule_next_chunks

    def add(self, request):
        pass  # the stub prefill chunks never complete a prompt


def make_scheduler(every=None, *, prefill=True, decode=True, mixed=False):
    """A Scheduler with DecodeInterleavePolicy(every) unless `every` is None, and MixedSteps with `mixed`."""
    prefill_stub = StubManager(lambda: (StepRow.chunk(Request("p", [1, 2]), 0, 1),), prefill)
    decode_stub = StubManager(lambda: (StepRow.next_token(Request("d", [1])),), decode)
    policies = ([] if every is None else [DecodeInterleavePolicy(every)]) + ([MixedSteps()] if mixed else [])
    return Scheduler(prefill_stub, decode_stub, policies), prefill_stub, decode_stub


def counts(scheduler):
    """(steps that prefilled, decode-only steps, forced decode steps)."""
    c = scheduler.counts
    return c.prefill, c.decode, c.forced_total


def letter(plan):
    return "-" if plan is None else {StepKind.PREFILL: "P", StepKind.DECODE: "D", StepKind.MIXED: "M"}[plan.kind]


def steps(scheduler, n):
    return "".join(letter(scheduler.schedule()) for _ in range(n))


@pytest.mark.parametrize(
    "every, expected",
    [
        (None, "PPPPPPPPP"),
        (1, "PDPDPDPDP"),
        (3, "PPPDPPPDP"),
        (8, "PPPPPPPPD"),
    ],
)
def test_truth_table_with_both_always_runnable(every, expected):
    scheduler, _, _ = make_scheduler(every)
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
    assert scheduler.policies[0].streak == 5  # not reset: the due state latched
    decode.runnable = True
    assert steps(scheduler, 1) == "D"
    assert steps(scheduler, 6) == "PPDPPD"  # the counting restarted from zero


@pytest.mark.parametrize("every", [None, 1, 3])
def test_pure_decode_fallback_when_no_prefill(every):
    scheduler, prefill, decode = make_scheduler(every, prefill=False)
    batches = [scheduler.schedule() for _ in range(5)]
    assert "".join(map(letter, batches)) == "DDDDD"
    assert [b.forced_by for b in batches] == [None] * 5  # every decode was the fallback
    assert prefill.calls == 5 and decode.calls == 5
    assert counts(scheduler) == (0, 5, 0)


@pytest.mark.parametrize("every", [None, 2])
def test_no_work_returns_none_and_counts_nothing(every):
    scheduler, prefill, decode = make_scheduler(every, prefill=False, decode=False)
    assert [scheduler.schedule() for _ in range(4)] == [None] * 4
    assert prefill.calls == 4 and decode.calls == 4
    assert counts(scheduler) == (0, 0, 0)


def test_decode_never_probed_while_prefill_has_work_without_a_policy():
    scheduler, prefill, decode = make_scheduler()
    steps(scheduler, 50)
    assert prefill.calls == 50
    assert decode.calls == 0


@pytest.mark.parametrize("every", [0, -3])
def test_the_policy_refuses_a_count_that_asks_for_nothing(every):
    with pytest.raises(ValueError, match="must be positive"):
        DecodeInterleavePolicy(every)


def test_797_steps_at_every_8_give_88_decodes_and_no_prefill_run_over_8():
    scheduler, _, _ = make_scheduler(8)
    trace = "".join(letter(scheduler.schedule()) for _ in range(797))
    assert trace.count("D") == 88 == 797 // 9
    assert max(len(list(run)) for key, run in itertools.groupby(trace) if key == "P") == 8
    assert counts(scheduler) == (709, 88, 88)


def test_idle_steps_earn_no_streak_credit():
    scheduler, prefill, decode = make_scheduler(2)
    trace = steps(scheduler, 1)
    prefill.runnable = decode.runnable = False
    trace += steps(scheduler, 5)
    assert scheduler.policies[0].streak == 1
    prefill.runnable = decode.runnable = True
    trace += steps(scheduler, 3)
    assert trace == "P-----PDP"


def test_forced_flag_marks_policy_decodes_only():
    scheduler, prefill, _ = make_scheduler(2)
    batches = [scheduler.schedule() for _ in range(3)]  # P P D(forced)
    prefill.runnable = False
    batches.append(scheduler.schedule())  # D (fallback)
    assert [(letter(b), b.forced_by) for b in batches] == [
        ("P", None),
        ("P", None),
        ("D", "interleave"),
        ("D", None),
    ]
    assert counts(scheduler) == (2, 2, 1)


def test_fallback_decode_also_restarts_the_count():
    scheduler, prefill, _ = make_scheduler(2)
    trace = steps(scheduler, 1)
    prefill.runnable = False
    trace += steps(scheduler, 1)  # fallback decode: the streak of 1 is reset
    prefill.runnable = True
    trace += steps(scheduler, 3)
    assert trace == "PDPPD"


@pytest.mark.parametrize(
    "prefill, decode, expected",
    [
        (True, True, "MMMM"),  # every prefill step carries the decode rows
        (True, False, "PPPP"),  # nothing decoding: pure prefill steps
        (False, True, "DDDD"),  # nothing to prefill: the decode rows run alone
        (False, False, "----"),
    ],
)
def test_mixed_steps_truth_table(prefill, decode, expected):
    scheduler, _, _ = make_scheduler(prefill=prefill, decode=decode, mixed=True)
    assert steps(scheduler, 4) == expected


def test_a_mixed_step_leaves_its_decode_rows_room_in_the_chunk_budget():
    scheduler, prefill, _ = make_scheduler(mixed=True)
    assert steps(scheduler, 2) == "MM"
    # The chunk gets what a pure chunk has, less the compiled mixed step's decode rows (here max_num_seqs = 4).
    assert prefill.budgets == [256 - 4] * 2


def test_a_mixed_step_leaves_verify_rows_room_for_their_drafts_too():
    """With speculative decoding a decode row carries k + 1 tokens (its last token and k drafts): the chunk leaves
    them all room, as the compiled mixed shape does (Buckets.mixed_shape)."""
    scheduler, prefill, _ = make_scheduler(mixed=True)
    scheduler.set_step_limits(StepLimits(256, 2, 4, mixed_decode_rows=4, decode_row_tokens=3))
    assert steps(scheduler, 2) == "MM"
    assert prefill.budgets == [256 - 4 * 3] * 2


def test_mixed_steps_reset_the_interleave_count_so_it_never_forces_a_decode():
    scheduler, _, _ = make_scheduler(2, mixed=True)
    assert steps(scheduler, 9) == "M" * 9
    assert counts(scheduler) == (9, 0, 0)
