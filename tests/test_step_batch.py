"""The step batch (jaxserve/request/batch.py): a plan's rows as the read-only host arrays the runner takes, and the
late hook that asks for what depends on the tokens before the step."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.request import Request, SamplingParams
from jaxserve.request.batch import StepBatch
from jaxserve.request.step import StepPlan, StepRow


def test_a_mixed_plan_becomes_one_entry_per_row_in_each_group():
    first = Request("a", [10, 11, 12, 13, 14], SamplingParams(prompt_logprobs=2), slot=3, pages=[7, 8])
    last = Request("b", [20, 21, 22], SamplingParams(logprobs=1), slot=5, pages=[9])
    decoding = Request("c", [30, 31], SamplingParams(logprobs=4), slot=1, pages=[4, 5, 6], num_sampled=2)
    plan = StepPlan(
        prefill=(
            StepRow.chunk(first, 1, 3, read_row=12, snapshot=(14, 2)),  # tokens 11..13, not the prompt's end
            StepRow.chunk(last, 1, 2),  # tokens 21, 22: the prompt's last chunk
        ),
        decode=(StepRow.next_token(decoding),),
    )
    batch = StepBatch.of(plan)
    assert batch.mixed and batch.prefill is not None and batch.decode is not None
    prefill, decode = batch.prefill, batch.decode
    assert prefill.tokens.tolist() == [[11, 12, 13], [21, 22, 0]]
    assert prefill.positions.tolist() == [1, 1] and prefill.lengths.tolist() == [3, 2] and prefill.longest == 3
    assert prefill.slots.tolist() == [3, 5] and prefill.read_rows.tolist() == [12, 5]
    assert prefill.snapshot_rows.tolist() == [14, -1] and prefill.snapshot_tokens.tolist() == [2, 0]
    assert prefill.page_table.tolist() == [[7, 8], [9, 0]] and prefill.page_counts.tolist() == [2, 1]
    assert prefill.keeps.tolist() == [False, True]
    # The prompt token after each position: a prompt's last token has none.
    assert prefill.next_tokens.tolist() == [[12, 13, 14], [22, 0, 0]] and prefill.next_counts.tolist() == [3, 1]
    assert prefill.logprobs.tolist() == [-1, 1] and prefill.prompt_logprobs.tolist() == [2, -1]
    assert prefill.output_numbers.tolist() == [-1, 0]  # the first row's token is dropped; the second is output 0
    # The decode row feeds the token its slot kept: the second one sampled, at position 3 (the prompt's 2 before it).
    assert decode.tokens.tolist() == [[0]] and decode.positions.tolist() == [3] and decode.lengths.tolist() == [1]
    assert (
        decode.keeps.tolist() == [True] and decode.logprobs.tolist() == [4] and decode.prompt_logprobs.tolist() == [-1]
    )
    assert decode.output_numbers.tolist() == [2] and decode.params == (decoding.sampling,)
    # The tokens before each row's first (an Engram hashes the n-grams ending in its tokens), oldest first: -1
    # before the sequence's start, and for an output token the host does not have yet.
    assert prefill.context.tolist() == [[-1] * 6 + [10], [-1] * 6 + [20]]
    assert decode.context.tolist() == [[-1] * 4 + [30, 31, -1]]
    decoding.output_ids.append(32)
    assert StepBatch.of(plan).decode.context.tolist() == [[-1] * 4 + [30, 31, 32]]


def test_its_arrays_are_read_only():
    request = Request("a", [1, 2, 3], slot=0, pages=[0])
    group = StepBatch.of(StepPlan(prefill=(StepRow.chunk(request, 0, 3),))).prefill
    assert group is not None
    arrays = [value for value in vars(group).values() if isinstance(value, np.ndarray)]
    assert len(arrays) == 16
    for array in arrays:
        with pytest.raises(ValueError, match="read-only"):
            array[...] = 0


def test_the_late_hook_asks_grammars_and_token_counts_only_for_rows_that_sample_an_output_token():
    allowed = Request("a", [1, 2], SamplingParams(allowed_token_ids=[3, 40]), slot=0, pages=[0], num_sampled=1)
    penalized = Request("b", [5, 5, 6], SamplingParams(repetition_penalty=1.5), slot=1, pages=[1], num_sampled=1)
    penalized.output_ids = [7]
    mid_prompt = Request("c", [1, 2, 3, 4], SamplingParams(frequency_penalty=1.0), slot=2, pages=[2])
    plan = StepPlan(
        prefill=(StepRow.chunk(mid_prompt, 0, 2),),  # not its prompt's end: its token is dropped
        decode=(StepRow.next_token(allowed), StepRow.next_token(penalized)),
    )
    batch = StepBatch.of(plan)
    assert batch.prefill is not None and batch.decode is not None
    prefill_late = batch.prefill.late(2)
    assert prefill_late.masks is None and prefill_late.penalty_entries == (None,)
    late = batch.decode.late(2)  # 64 token ids
    assert late.masks is not None and late.masks.shape == (2, 2)
    bits = np.unpackbits(late.masks.view(np.uint8), bitorder="little").reshape(2, 64)
    assert np.flatnonzero(bits[0]).tolist() == [3, 40] and bits[1].all()  # the unconstrained row allows all
    assert late.penalty_entries[0] is None
    ids, counts = late.penalty_entries[1]
    assert dict(zip(ids.tolist(), counts.tolist())) == {5: 0.0, 6: 0.0, 7: 1.0}  # the prompt's with repetition


def test_a_row_of_a_request_without_a_slot_is_refused_naming_it():
    with pytest.raises(ValueError, match="'lost'.*without a slot"):
        StepBatch.of(StepPlan(prefill=(StepRow.chunk(Request("lost", [1, 2]), 0, 2),)))
