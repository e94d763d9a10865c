"""On-device sampling: penalties, logit biases, allowed tokens, greedy, temperature, min-p, top-k, top-p,
per-request seeds independent of the batch."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import jax
import numpy as np

from jaxserve.request import Request, SamplingParams
from jaxserve.request.batch import GroupBatch
from jaxserve.request.grammar import mask_words
from jaxserve.request.step import StepRow
from jaxserve.runner.sampling import NO_TOKEN, PenaltyArrays, SamplingArrays, apply_penalties, sample

sample_jit = jax.jit(sample)
MAX_VOCAB = 1024


def _params(n, temperature=1.0, top_k=-1, top_p=1.0, seed=0, position=1, logit_bias=(), bucket=None):
    """Arrays for n decode rows (of one-token prompts) sampling at `position`, in a bucket of `bucket` rows."""

    def fill(value):
        return value if isinstance(value, list) else [value] * n

    rows = [
        StepRow(
            Request(f"r{i}", [1], SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, logit_bias=b), slot=i),
            position - 1,
            1,
            decode=True,
        )
        for i, (t, k, p, s, b, position) in enumerate(
            zip(fill(temperature), fill(top_k), fill(top_p), fill(seed), fill(logit_bias), fill(position))
        )
    ]
    return _arrays(rows, bucket or n, MAX_VOCAB)


def _arrays(rows, bucket, vocab):
    """The sampling arrays the runner makes of decode `rows` in a bucket of `bucket` rows, their late masks asked."""
    group = GroupBatch.of(rows, decode=True)
    # The runner's all-ones mask for groups without constraints, here on the host.
    everything: Any = np.full((bucket, mask_words(vocab)), -1, np.int32)
    return SamplingArrays.for_group(group, bucket, everything, group.late(mask_words(vocab)).masks)


def _penalties(rows, bucket):
    group = GroupBatch.of(rows, decode=True)
    return PenaltyArrays.for_group(group, group.late(mask_words(MAX_VOCAB)), bucket)


def _logits(rows=4, vocab=50, seed=0):
    return np.random.default_rng(seed).normal(size=(rows, vocab)).astype(np.float32) * 3


def test_greedy_is_argmax():
    logits = _logits()
    out = sample_jit(logits, _params(4, temperature=0.0, seed=[1, 2, 3, 4]))
    np.testing.assert_array_equal(out, logits.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy_at_any_temperature():
    logits = _logits()
    np.testing.assert_array_equal(sample_jit(logits, _params(4, temperature=5.0, top_k=1)), logits.argmax(-1))
    np.testing.assert_array_equal(sample_jit(logits, _params(4, temperature=5.0, top_p=1e-6)), logits.argmax(-1))


def test_top_k_limits_the_support():
    logits = np.tile(_logits(1), (256, 1))
    allowed = set(np.argsort(logits[0])[::-1][:3].tolist())
    out = sample_jit(logits, _params(256, temperature=2.0, top_k=3, position=list(range(1, 257))))
    assert set(out.tolist()) == allowed  # all three appear over 256 draws, nothing else does


def test_top_p_keeps_the_smallest_nucleus():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    logits = np.tile(row, (256, 1))
    out = sample_jit(logits, _params(256, top_p=0.7, position=list(range(1, 257))))
    assert set(out.tolist()) == {0, 1}  # 0.5 < 0.7 needs the second token; the third is never needed


def test_seeded_rows_do_not_depend_on_their_batch():
    logits = _logits(rows=6, seed=5)
    alone = [int(sample_jit(logits[i : i + 1], _params(1, seed=100 + i, position=7 + i))[0]) for i in range(6)]
    batched = sample_jit(logits, _params(6, seed=[100 + i for i in range(6)], position=[7 + i for i in range(6)]))
    reversed_rows = sample_jit(
        logits[::-1], _params(6, seed=[105 - i for i in range(6)], position=[12 - i for i in range(6)])
    )
    assert batched.tolist() == alone
    assert reversed_rows.tolist()[::-1] == alone
    other_seed = sample_jit(logits, _params(6, seed=[7 for _ in range(6)], position=[7 + i for i in range(6)]))
    assert other_seed.tolist() != alone  # the seed matters


def test_a_row_draws_the_same_token_whatever_its_batch_mates_filter():
    # A batch sorts the vocabulary only when some row filters (top-k / top-p) and samples only when some row has a
    # temperature; a row must not see which path its batch took.
    logits = np.tile(_logits(1, seed=3), (64, 1))
    plain = sample_jit(logits, _params(64, temperature=1.5, position=list(range(64))))
    assert len(set(plain.tolist())) > 3  # really sampled
    with_filtering_mate = sample_jit(
        np.concatenate([logits, logits[:1]]),
        _params(65, temperature=[1.5] * 64 + [1.0], top_k=[-1] * 64 + [3], position=list(range(64)) + [0]),
    )
    np.testing.assert_array_equal(with_filtering_mate[:64], plain)
    # The runner samples a batch with no cut through the sampler that does not sort: the same tokens.
    uncut = _params(64, temperature=1.5, position=list(range(64)))
    assert not uncut.cuts() and _params(65, top_k=[-1] * 64 + [3]).cuts() and _params(2, top_p=[1.0, 0.9]).cuts()
    np.testing.assert_array_equal(jax.jit(sample, static_argnames="cuts")(logits, uncut, cuts=False), plain)
    greedy_rows = sample_jit(logits, _params(64, temperature=0.0))
    with_sampling_mate = sample_jit(np.concatenate([logits, logits[:1]]), _params(65, temperature=[0.0] * 64 + [1.0]))
    np.testing.assert_array_equal(with_sampling_mate[:64], greedy_rows)
    np.testing.assert_array_equal(greedy_rows, logits.argmax(-1))


def test_logit_bias_moves_greedy_and_sampled_rows_and_padding_rows_carry_none():
    logits = _logits(rows=3, vocab=50, seed=2)
    best = logits.argmax(-1)
    favoured, banned = 7, [int(t) for t in best]
    params = _params(
        3, temperature=[0.0, 0.0, 5.0], logit_bias=[{favoured: 100.0}, {banned[1]: -100.0}, {favoured: 100.0}], bucket=4
    )
    out = sample_jit(np.concatenate([logits, logits[:1]]), params)
    assert out[0] == favoured and out[1] != banned[1] and out[2] == favoured
    assert out[3] == best[0]  # the padding row: no bias
    assert (params.bias_ids[3] == np.iinfo(np.int32).max).all()


def test_a_bias_entry_outside_the_vocabulary_is_dropped():
    logits = _logits(rows=1, vocab=50)
    params = _params(1, temperature=0.0)
    params.bias_ids[0, 0], params.bias[0, 0] = 10_000, 100.0
    assert int(sample_jit(logits, params)[0]) == int(logits.argmax(-1)[0])


def test_penalties_follow_vllms_formulas():
    # Row 0: tokens 0 (out twice) and 1 (prompt only) seen; repetition 2 halves a positive logit and doubles a
    # negative one, then frequency 0.5 per time out and presence 1 once for a token out.
    logits = np.array([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]], np.float32)
    penalties = PenaltyArrays(
        token_ids=np.array([[0, 1, NO_TOKEN], [NO_TOKEN] * 3], np.int32),
        output_counts=np.array([[2, 0, 0], [0, 0, 0]], np.float32),
        repetition=np.array([2.0, 1.0], np.float32),
        frequency=np.array([0.5, 0.0], np.float32),
        presence=np.array([1.0, 0.0], np.float32),
    )
    out = np.asarray(jax.jit(apply_penalties)(logits, penalties))
    np.testing.assert_allclose(out[0], [2 / 2 - 0.5 * 2 - 1, -1 * 2, 0.5, 3.0])
    np.testing.assert_array_equal(out[1], logits[1])  # a neutral row is untouched


def test_penalty_arrays_count_the_output_and_see_the_prompt_only_with_repetition():
    def row(sampling):
        request = Request("r", [4, 4, 9], sampling, slot=0)
        request.output_ids = [7, 4, 7]
        return StepRow(request, 5, 1, decode=True)

    frequency = _penalties([row(SamplingParams(frequency_penalty=1.0))], 2)
    assert frequency is not None and frequency.token_ids.shape == (2, 64)
    seen = dict(zip(frequency.token_ids[0].tolist(), frequency.output_counts[0].tolist()))
    assert {t: c for t, c in seen.items() if t != NO_TOKEN} == {7: 2.0, 4: 1.0}
    repetition = _penalties([row(SamplingParams(repetition_penalty=1.3))], 1)
    assert repetition is not None
    seen = dict(zip(repetition.token_ids[0].tolist(), repetition.output_counts[0].tolist()))
    assert {t: c for t, c in seen.items() if t != NO_TOKEN} == {4: 1.0, 9: 0.0, 7: 2.0}
    assert _penalties([row(SamplingParams())], 1) is None  # no penalty: the logits go untouched


def test_token_occurrences_grow_with_the_output_and_their_bucket_doubles():
    request = Request("r", [1], SamplingParams(presence_penalty=0.5), slot=0)
    rng = np.random.default_rng(0)
    for _ in range(5):
        request.output_ids += rng.integers(0, 500, 40).tolist()
        ids, counts = request.penalty_entries()
        expected = Counter(request.output_ids)
        assert dict(zip(ids.tolist(), counts.tolist())) == expected
    arrays = _penalties([StepRow(request, len(request.output_ids), 1, decode=True)], 1)
    assert arrays is not None and arrays.token_ids.shape[1] == 1 << (len(expected) - 1).bit_length()


def test_min_p_drops_the_unlikely_tokens():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    logits = np.tile(row, (256, 1))
    params = dataclasses.replace(_params(256, position=list(range(1, 257))), min_p=np.full(256, 0.35, np.float32))
    assert set(sample_jit(logits, params).tolist()) == {0, 1}  # 0.15 < 0.35 * 0.5
    everything = dataclasses.replace(params, min_p=np.zeros(256, np.float32))
    assert set(sample_jit(logits, everything).tolist()) == {0, 1, 2, 3}


def test_allowed_token_ids_are_all_a_row_samples():
    logits = _logits(rows=64, vocab=100, seed=3)
    allowed = [3, 40, 41, 97]
    rows = [
        StepRow(Request(f"r{i}", [1], SamplingParams(seed=i, allowed_token_ids=allowed), slot=i), 0, 1, decode=True)
        for i in range(64)
    ]
    params = _arrays(rows, 64, 100)
    assert set(sample_jit(logits, params).tolist()) <= set(allowed)
    greedy = dataclasses.replace(params, temperature=np.zeros(64, np.float32))
    best = [allowed[int(np.argmax(logits[i, allowed]))] for i in range(64)]
    assert sample_jit(logits, greedy).tolist() == best
