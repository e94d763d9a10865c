"""DecodeInterleavePolicy on its own: the counter semantics of docs/scheduling.md."""

import pytest

from jaxserve.scheduler import DecodeInterleavePolicy


@pytest.mark.parametrize("every", [None, 0, -3])
def test_disabled_never_wants_a_decode(every):
    policy = DecodeInterleavePolicy(every)
    assert not policy.enabled
    for _ in range(20):
        policy.note_prefill()
    assert not policy.wants_decode()
    assert policy.streak == 0  # a disabled policy is inert


def test_due_after_every_prefills_and_reset_by_a_decode():
    policy = DecodeInterleavePolicy(3)
    assert policy.enabled
    wanted = []
    for _ in range(3):
        wanted.append(policy.wants_decode())
        policy.note_prefill()
    assert wanted == [False, False, False]
    assert policy.streak == 3 and policy.wants_decode()
    policy.note_decode()
    assert policy.streak == 0 and not policy.wants_decode()


def test_due_state_latches_until_a_decode():
    policy = DecodeInterleavePolicy(2)
    for _ in range(5):  # due after 2, then three more prefills because no decode was runnable
        policy.note_prefill()
    assert policy.streak == 5 and policy.wants_decode()
    policy.note_decode()
    assert policy.streak == 0 and not policy.wants_decode()


def test_every_one_is_due_after_a_single_prefill():
    policy = DecodeInterleavePolicy(1)
    assert not policy.wants_decode()  # starts with prefill
    policy.note_prefill()
    assert policy.wants_decode()


def test_reset_clears_the_streak():
    policy = DecodeInterleavePolicy(2)
    policy.note_prefill()
    policy.note_prefill()
    policy.reset()
    assert policy.streak == 0 and not policy.wants_decode()


def test_streak_is_read_only():
    with pytest.raises(AttributeError):
        DecodeInterleavePolicy(2).streak = 7
