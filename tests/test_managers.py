"""Request records, the id allocator (pages and slots), PrefillManager and DecodeManager, and the hand-off
between them through the real Scheduler."""

import json
import random

import pytest

from jaxserve.request import (
    LEGAL_TRANSITIONS,
    FinishReason,
    IllegalTransition,
    InvalidRequest,
    Request,
    RequestStatus,
    SamplingParams,
)
from jaxserve.request.step import StepKind
from jaxserve.scheduler import (
    DecodeInterleavePolicy,
    DecodeManager,
    Exhausted,
    FirstComeFirstServed,
    IdAllocator,
    MixedSteps,
    PrefillManager,
    Priority,
    Scheduler,
)

PAGE = 4  # tokens per KV page in these tests


def req(rid, prompt_len, max_tokens=4):
    return Request(rid, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def chunks(prefill):
    """(request, start, length) of each chunk of a prefill manager's step, or of a StepPlan's prefill part."""
    return [(c.request.request_id, c.start, c.length) for c in getattr(prefill, "prefill", prefill)]


def manager(num_pages=64, budget=8, rows=4, slots=4, order=None):
    pool = IdAllocator(num_pages, "KV pages")
    return PrefillManager(pool, PAGE, budget, rows, IdAllocator(slots, "slots"), order), pool


def next_chunks(pm):
    """The prefill manager's next step within its configured knobs (what the Scheduler asks without other limits)."""
    return pm.schedule_next_chunks(pm.max_prefill_tokens, pm.max_prefill_rows, pm.slots.size)


def next_rows(dm):
    return tuple(row.request for row in dm.schedule_next_rows(dm.max_num_seqs))


# --- request records -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", -1),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", 21),
    ],
)
def test_sampling_params_reject_bad_values_naming_field_and_value(field, value):
    with pytest.raises(InvalidRequest, match=f"{field}={value!r}") as refused:
        SamplingParams(**{field: value})
    assert refused.value.param == field


def test_sampling_params_store_stop_ids_as_tuple():
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)


def test_request_lengths():
    r = req("a", 10, max_tokens=5)
    r.num_prefilled = 4
    r.output_ids = [7, 8]
    assert (r.prompt_len, r.remaining_prompt, r.prefill_done, r.total_len, r.max_total_len) == (10, 6, False, 12, 15)
    r.num_prefilled = 10
    assert r.prefill_done and r.remaining_prompt == 0


def test_empty_prompt_is_refused():
    with pytest.raises(InvalidRequest, match="is empty"):
        Request("a", [])


def test_id_allocator_hands_out_low_ids_all_or_nothing_and_checks_frees():
    pool = IdAllocator(8, "KV pages")
    assert pool.allocate(3) == [0, 1, 2] and pool.allocate(2) == [3, 4]
    with pytest.raises(Exhausted, match="asked for 4 KV pages but only 3 of 8 are free"):
        pool.allocate(4)
    assert (pool.num_free, pool.num_used) == (3, 5)  # the refused allocation took nothing
    pool.free([1, 3])
    assert sorted(pool.allocate(2)) == [1, 3]  # the freed ones, and only they
    with pytest.raises(ValueError, match=r"freeing KV pages that are not allocated \(or twice\): \[5\]"):
        pool.free([0, 5])
    with pytest.raises(ValueError, match="or twice"):
        pool.free([0, 0])
    assert pool.num_used == 5  # refused frees changed nothing
    with pytest.raises(ValueError, match="slots: 0 in total"):
        IdAllocator(0, "slots")


# --- prefill manager -----------------------------------------------------------------------------------------


def test_long_prompt_is_split_into_budget_sized_chunks():
    pm, pool = manager(budget=8)
    a = req("a", 20, max_tokens=4)
    pm.add(a)
    assert a.status is RequestStatus.WAITING and pm.num_waiting == 1
    b1 = next_chunks(pm)
    assert chunks(b1) == [("a", 0, 8)]
    assert a.status is RequestStatus.PREFILLING and a.num_prefilled == 8 and pm.num_waiting == 0
    assert len(a.pages) == 6 and pool.num_used == 6  # all of ceil((20 + 4) / 4) reserved at admission
    b2, b3 = next_chunks(pm), next_chunks(pm)
    assert chunks(b2) == [("a", 8, 8)] and chunks(b3) == [("a", 16, 4)]
    assert [c.samples_output for c in b1 + b2 + b3] == [False, False, True]
    assert b3[0].token_ids == a.prompt_ids[16:20]
    assert next_chunks(pm) == () and not pm.has_work
    assert pool.num_used == 6  # pages stay with the request until it finishes


def test_in_progress_prompt_continues_first_then_fifo_fills_the_budget():
    pm, _ = manager(budget=8, slots=8)
    for rid, n in [("a", 3), ("b", 3), ("c", 5), ("d", 2), ("e", 9)]:
        pm.add(req(rid, n))
    assert chunks(next_chunks(pm)) == [("a", 0, 3), ("b", 0, 3), ("c", 0, 2)]
    assert chunks(next_chunks(pm)) == [("c", 2, 3), ("d", 0, 2), ("e", 0, 3)]
    assert chunks(next_chunks(pm)) == [("e", 3, 6)]


def test_row_limit_caps_chunks_per_batch():
    pm, _ = manager(budget=100, rows=2)
    for rid in "abc":
        pm.add(req(rid, 2))
    assert chunks(next_chunks(pm)) == [("a", 0, 2), ("b", 0, 2)]
    assert chunks(next_chunks(pm)) == [("c", 0, 2)]


def test_admission_stops_fifo_when_pages_run_out():
    pm, pool = manager(num_pages=10, budget=100)
    a, b, c = req("a", 8, max_tokens=8), req("b", 16, max_tokens=16), req("c", 2, max_tokens=2)  # 4, 8, 1 pages
    for r in (a, b, c):
        pm.add(r)
    assert chunks(next_chunks(pm)) == [("a", 0, 8)]
    # b needs 8 pages, 6 are free; c would fit but must not overtake b.
    assert next_chunks(pm) == ()
    assert (b.status, c.status, pm.num_waiting, pool.num_free) == (RequestStatus.WAITING, RequestStatus.WAITING, 2, 6)
    pm.remove(a)  # a finished
    pm.release(a)
    assert pool.num_free == 10 and a.pages == [] and a.slot is None
    assert chunks(next_chunks(pm)) == [("b", 0, 16), ("c", 0, 2)]
    assert pool.num_free == 1


def test_admission_stops_fifo_when_slots_run_out():
    pm, pool = manager(budget=100, slots=1)
    a, b = req("a", 3), req("b", 3)
    pm.add(a)
    pm.add(b)
    assert chunks(next_chunks(pm)) == [("a", 0, 3)]
    assert next_chunks(pm) == () and b.status is RequestStatus.WAITING and b.pages == []
    pm.remove(a)
    pm.release(a)
    assert chunks(next_chunks(pm)) == [("b", 0, 3)] and b.slot == 0


def test_finishing_frees_pages_and_slot_of_waiting_and_in_progress_requests_once():
    pm, pool = manager(num_pages=20, slots=2)
    scheduler = Scheduler(pm, DecodeManager(2))
    a, b = req("a", 20), req("b", 4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert chunks(scheduler.schedule()) == [("a", 0, 8)]  # a in progress, b waiting
    scheduler.finish(b, "abort")
    assert b.status is RequestStatus.ABORTED and b.finish_reason == "abort" and b.finished
    scheduler.finish(a, "abort")
    assert (pool.num_free, pm.slots.num_free, a.pages, a.slot) == (20, 2, [], None)
    with pytest.raises(IllegalTransition, match="aborted -> aborted"):
        scheduler.finish(a, "abort")  # again: a bug, refused before anything is freed twice
    assert pool.num_free == 20 and scheduler.schedule() is None and not pm.has_work


def test_finish_reasons_are_the_api_words_and_an_unknown_one_is_refused_before_any_move():
    assert [reason.value for reason in FinishReason] == ["stop", "length", "abort", "error"]
    assert json.dumps({"finish_reason": FinishReason.LENGTH}) == '{"finish_reason": "length"}'
    pm, _ = manager()
    scheduler = Scheduler(pm, DecodeManager(2))
    a = req("a", 4)
    scheduler.add_request(a)
    with pytest.raises(ValueError, match="'done' is not a valid FinishReason"):
        scheduler.finish(a, "done")  # type: ignore[arg-type]
    assert a.status is RequestStatus.WAITING and not a.finished
    scheduler.finish(a, FinishReason.STOP)
    assert a.status is RequestStatus.FINISHED and a.finish_reason is FinishReason.STOP


# --- decode manager ------------------------------------------------------------------------------------------


def test_decode_manager_batches_oldest_first_up_to_max_num_seqs():
    dm = DecodeManager(max_num_seqs=2)
    assert next_rows(dm) == () and not dm.has_work
    a, b, c = req("a", 1), req("b", 1), req("c", 1)
    for r in (a, b, c):
        r.status = RequestStatus.PREFILLING  # as the prefill manager leaves it
        dm.add(r)
    assert a.status is RequestStatus.DECODING and dm.running == [a, b, c]
    assert next_rows(dm) == (a, b)
    dm.remove(a)
    dm.remove(a)  # absent: no-op
    assert next_rows(dm) == (b, c)
    with pytest.raises(ValueError, match="already decoding"):
        dm.add(b)


# --- hand-off through the Scheduler --------------------------------------------------------------------------


def test_completed_prompts_decode_in_the_next_step_even_before_their_step_ran():
    pm, pool = manager(budget=12)
    scheduler = Scheduler(pm, DecodeManager(4))
    a, b, c = req("a", 4), req("b", 4), req("c", 4, max_tokens=1)
    for r in (a, b, c):
        scheduler.add_request(r)
    plan = scheduler.schedule()
    assert plan.completed == [a, b, c]
    assert [r.num_sampled for r in (a, b, c)] == [1, 1, 1]  # scheduling records the first token each samples
    # The step is in flight: its first tokens are still on the device, which is where decode rows read them from.
    # c's only token is the one being sampled: it gets no row.
    assert (a.status, b.status) == (RequestStatus.DECODING, RequestStatus.DECODING)
    decode = scheduler.schedule().decode
    assert [(row.request, row.start) for row in decode] == [(a, 4), (b, 4)]  # after the prompt's 4 tokens
    scheduler.finish(b, "abort")  # aborted while its last chunk was in flight
    scheduler.on_step_done(plan, 0.01)
    scheduler.finish(c, "length")
    assert [(row.request, row.start) for row in scheduler.schedule().decode] == [(a, 5)]
    scheduler.finish(a, "length")
    assert a.finish_reason == "length" and pool.num_free == 64 and not scheduler.has_work


def test_random_workload_returns_every_page_and_slot():
    rng = random.Random(0)
    pool, slots = IdAllocator(40, "KV pages"), IdAllocator(3, "slots")
    pm = PrefillManager(pool, PAGE, max_prefill_tokens=16, max_prefill_rows=2, slots=slots)
    scheduler = Scheduler(pm, DecodeManager(3), [DecodeInterleavePolicy(2)])
    requests = [req(f"r{i}", rng.randint(1, 60), max_tokens=rng.randint(1, 30)) for i in range(60)]
    for r in requests:
        scheduler.add_request(r)
    live = list(requests)
    for _ in range(10_000):
        batch = scheduler.schedule()
        if batch is None:
            break
        # Deliver: one sampled token per completed prompt or decoding request, then stop checks.
        produced = batch.completed + [row.request for row in batch.decode]
        for r in produced:
            r.output_ids.append(0)
            if len(r.output_ids) == r.sampling.max_tokens:
                scheduler.finish(r, "length")
        for r in list(live):
            if not r.finished and rng.random() < 0.01:
                scheduler.finish(r, "abort")
        scheduler.on_step_done(batch, 0.01)
        live = [r for r in live if not r.finished]
        assert pool.num_used == sum(len(r.pages) for r in live)
        assert 3 - slots.num_free == sum(r.slot is not None for r in live)
    assert not scheduler.has_work and live == []
    assert pool.num_free == 40 and slots.num_free == 3
    finished = [r for r in requests if r.finish_reason == "length"]
    assert finished and all(len(r.output_ids) == r.sampling.max_tokens for r in finished)
    assert scheduler.counts.decode > 0 and scheduler.counts.prefill > 0


# --- mixed batches ---------------------------------------------------------------------------------------------


def test_mixed_steps_carry_every_running_request_inside_a_pure_chunks_token_budget():
    prefill, _ = manager(budget=8)
    scheduler = Scheduler(prefill, DecodeManager(4), [DecodeInterleavePolicy(3), MixedSteps()])
    a, b = req("a", 3, max_tokens=50), req("b", 3, max_tokens=50)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()  # nothing is running yet: a plain prefill step
    assert first.kind is StepKind.PREFILL and chunks(first) == [("a", 0, 3), ("b", 0, 3)]
    scheduler.on_step_done(first, 0.01)
    c = req("c", 20)
    scheduler.add_request(c)
    steps = []
    while c.remaining_prompt:
        plan = scheduler.schedule()
        assert plan.kind is StepKind.MIXED and [row.request for row in plan.decode] == [a, b]
        # The chunk leaves room for the mixed step's decode group (max_num_seqs = 4 rows, padded): 8 - 4 tokens.
        assert plan.num_prefill_tokens <= 8 - 4
        steps.append(chunks(plan))
        scheduler.on_step_done(plan, 0.01)
    assert steps == [[("c", 0, 4)], [("c", 4, 4)], [("c", 8, 4)], [("c", 12, 4)], [("c", 16, 4)]]
    # The count policy never forces a separate decode: every step already advanced the running requests.
    assert (scheduler.counts.prefill, scheduler.counts.mixed, scheduler.counts.decode) == (6, 5, 0)
    assert scheduler.schedule().kind is StepKind.DECODE  # no prefill left: plain decode of a, b and c


# --- the lifecycle -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("start", list(RequestStatus))
@pytest.mark.parametrize("end", list(RequestStatus))
def test_every_move_follows_the_one_table(start, end):
    legal = {(RequestStatus.WAITING, RequestStatus.PREFILLING), (RequestStatus.PREFILLING, RequestStatus.DECODING)}
    legal |= {
        (s, e)
        for s in (RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.DECODING)
        for e in (RequestStatus.FINISHED, RequestStatus.ABORTED)
    }
    assert (end in LEGAL_TRANSITIONS[start]) == ((start, end) in legal)
    r = req("a", 2)
    r.status = start  # set up the state under test directly
    if (start, end) in legal:
        r.move_to(end)
        assert r.status is end and r.finished == (end in (RequestStatus.FINISHED, RequestStatus.ABORTED))
    else:
        with pytest.raises(IllegalTransition, match=f"{start.value} -> {end.value}"):
            r.move_to(end)
        assert r.status is start


def test_a_request_is_added_to_the_queue_only_while_waiting():
    pm, _ = manager()
    a = req("a", 2)
    pm.add(a)
    next_chunks(pm)
    with pytest.raises(ValueError, match="is prefilling, not waiting"):
        pm.add(a)


# --- queue orders ------------------------------------------------------------------------------------------------


def prioritized(rid, priority):
    r = req(rid, 4)
    r.priority = priority
    return r


@pytest.mark.parametrize(
    "order, arrivals, expected",
    [
        # (request id, priority) in arrival order -> admission order, one request per step (a 4-token budget)
        (FirstComeFirstServed(), [("a", 0), ("b", 0), ("c", 0)], "abc"),
        (FirstComeFirstServed(), [("a", 5), ("b", -1), ("c", 0)], "abc"),  # fcfs ignores priorities
        (Priority(), [("a", 0), ("b", 0), ("c", 0)], "abc"),  # equals: first come, first served
        (Priority(), [("a", 0), ("b", -1), ("c", 0)], "bac"),  # lower first
        (Priority(), [("a", 2), ("b", 1), ("c", 1), ("d", -3)], "dbca"),
    ],
)
def test_queue_order_truth_table(order, arrivals, expected):
    pm, _ = manager(budget=4, rows=1, order=order)
    for rid, priority in arrivals:
        pm.add(prioritized(rid, priority))
    admitted = "".join(next_chunks(pm)[0].request.request_id for _ in arrivals)
    assert admitted == expected


def test_priority_orders_waiting_requests_only_never_the_admitted_one():
    pm, _ = manager(budget=4, rows=1, order=Priority())
    long = prioritized("long", 5)
    long.prompt_ids = list(range(12))  # three chunks
    pm.add(long)
    assert chunks(next_chunks(pm)) == [("long", 0, 4)]
    pm.add(prioritized("urgent", -10))  # arrives while `long` is part-way: it waits for it (no preemption)
    assert chunks(next_chunks(pm)) == [("long", 4, 4)]
    assert chunks(next_chunks(pm)) == [("long", 8, 4)]
    assert chunks(next_chunks(pm)) == [("urgent", 0, 4)]


def test_fcfs_refuses_a_priority_naming_the_flag_and_priority_takes_any():
    with pytest.raises(InvalidRequest, match="--scheduling-policy priority") as refused:
        FirstComeFirstServed().check_priority(-1)
    assert refused.value.param == "priority"
    FirstComeFirstServed().check_priority(0)
    Priority().check_priority(-(2**40))


# --- the rules SamplingParams owns -------------------------------------------------------------------------------


def test_stop_rules_and_the_bias_follow_min_tokens():
    p = SamplingParams(
        max_tokens=8, min_tokens=3, stop_token_ids=(7,), eos_token_ids=(1, 2), logit_bias={5: 2.0, 7: 1.0}
    )
    assert [p.may_stop(n) for n in range(5)] == [False, False, False, True, True]
    assert p.stop_reason(1, 2) == (None, None) and p.stop_reason(7, 2) == (None, None)  # held back
    assert p.stop_reason(1, 3) == ("stop", None) and p.stop_reason(7, 3) == ("stop", 7)
    assert p.stop_reason(9, 8) == ("length", None)
    # A complete structured output stops whatever min_tokens, and outranks max_tokens as EOS does.
    assert p.stop_reason(9, 2, complete=True) == ("stop", None) and p.stop_reason(9, 8, complete=True) == ("stop", None)
    assert p.stop_reason(7, 3, complete=True) == ("stop", 7)
    minus = float("-inf")
    assert p.logit_bias_at(2) == ((5, 2.0), (1, minus), (2, minus), (7, minus))  # the bias on 7 is overridden
    assert p.logit_bias_at(3) == ((5, 2.0), (7, 1.0))
    ignoring = SamplingParams(max_tokens=8, min_tokens=3, eos_token_ids=(1,), ignore_eos=True)
    assert ignoring.logit_bias_at(0) == () and ignoring.stop_reason(1, 5) == (None, None)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 1, "stop_token_ids": tuple(range(60)), "eos_token_ids": tuple(range(60, 65))}, "min_tokens"),
        ({"logit_bias": {3: 100.5}}, "logit_bias"),
        ({"logit_bias": {t: 1.0 for t in range(65)}}, "logit_bias"),
    ],
)
def test_sampling_rules_refuse_what_they_cannot_do_naming_the_field(fields, param):
    with pytest.raises(InvalidRequest) as refused:
        SamplingParams(**fields)
    assert refused.value.param == param
