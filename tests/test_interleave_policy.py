"""DecodeInterleavePolicy on its own: the counter semantics of docs/scheduling.md, through the StepPolicy hooks."""

import pytest

from jaxserve.request import Request
from jaxserve.request.step import StepPlan, StepRow
from jaxserve.scheduler import DecodeInterleavePolicy

PREFILL = StepPlan(prefill=(StepRow.chunk(Request("p", [1, 2, 3]), 0, 2),))
DECODE = StepPlan(decode=(StepRow.next_token(Request("d", [1])),))
MIXED = StepPlan(prefill=PREFILL.prefill, decode=DECODE.decode)


def due(policy) -> bool:
    return policy.prefill_token_limit(256) == 0


@pytest.mark.parametrize("every", [0, -3])
def test_a_count_that_asks_for_nothing_is_refused(every):
    with pytest.raises(ValueError, match="decode_interleave_every"):
        DecodeInterleavePolicy(every)


@pytest.mark.parametrize(
    "every, scheduled, expected",
    [
        # after each scheduled step: is a decode due (0 tokens of prefill allowed)?
        (3, [PREFILL, PREFILL, PREFILL], [False, False, True]),
        (3, [PREFILL, PREFILL, PREFILL, DECODE], [False, False, True, False]),
        (1, [PREFILL, DECODE, PREFILL], [True, False, True]),
        (2, [PREFILL, MIXED, PREFILL, PREFILL], [False, False, False, True]),  # a mixed step decodes: it resets
        (2, [PREFILL, PREFILL, PREFILL, PREFILL, PREFILL], [False, True, True, True, True]),  # latched until a decode
    ],
)
def test_truth_table(every, scheduled, expected):
    policy = DecodeInterleavePolicy(every)
    assert not due(policy)  # starts with prefill
    seen = []
    for plan in scheduled:
        policy.on_scheduled(plan)
        seen.append(due(policy))
    assert seen == expected


def test_not_due_leaves_the_budget_whole_and_names_itself_on_forced_decodes():
    policy = DecodeInterleavePolicy(2)
    assert policy.prefill_token_limit(256) == 256 and policy.prefill_token_limit(64) == 64
    assert policy.name == "interleave"
    assert not policy.decode_rides_prefill


def test_streak_counts_prefill_steps_and_is_read_only():
    policy = DecodeInterleavePolicy(2)
    for _ in range(5):
        policy.on_scheduled(PREFILL)
    assert policy.streak == 5
    with pytest.raises(AttributeError):
        policy.streak = 7
