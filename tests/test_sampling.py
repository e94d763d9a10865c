"""On-device sampling: logit biases, greedy, temperature, top-k, top-p, per-request seeds independent of the
batch."""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.request import Request, SamplingParams
from jaxserve.request.grammar import mask_words
from jaxserve.request.step import StepRow
from jaxserve.runner.sampling import SamplingArrays, sample

sample_jit = jax.jit(sample)
MAX_VOCAB = 1024


def _params(n, temperature=1.0, top_k=-1, top_p=1.0, seed=0, position=1, logit_bias=(), bucket=None):
    """Arrays for n decode rows (of one-token prompts) sampling at `position`, in a bucket of `bucket` rows."""

    def fill(value):
        return value if isinstance(value, list) else [value] * n

    rows = [
        StepRow(
            Request(f"r{i}", [1], SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, logit_bias=b)),
            position - 1,
            1,
            decode=True,
        )
        for i, (t, k, p, s, b, position) in enumerate(
            zip(fill(temperature), fill(top_k), fill(top_p), fill(seed), fill(logit_bias), fill(position))
        )
    ]
    # Every token allowed (no structured output), for any vocabulary these tests use.
    return SamplingArrays.for_rows(rows, bucket or n, np.full((bucket or n, mask_words(MAX_VOCAB)), -1, np.int32))


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
