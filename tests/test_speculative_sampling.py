"""Speculative decoding's acceptance rule (jaxserve.runner.speculative): greedy rows keep exactly the drafts that are
the model's argmax; sampled rows keep each draft by rejection sampling, so every kept token follows the model's own
distribution whatever the drafts were."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare
from test_sampling import _params

from jaxserve.model.inputs import StepInputs
from jaxserve.runner.sampling import processed_logits
from jaxserve.runner.speculative import _accept

accept = jax.jit(_accept)
V = 6


def _inputs(rows: int, lengths: int | list[int]) -> StepInputs:
    return StepInputs(
        tokens=jnp.zeros((rows, 1), jnp.int32),
        positions=jnp.full(rows, 10, jnp.int32),
        lengths=jnp.asarray(np.broadcast_to(lengths, rows), jnp.int32),
        slots=jnp.arange(rows, dtype=jnp.int32),
        page_table=jnp.zeros((rows, 1), jnp.int32),
    )


def test_greedy_rows_keep_the_drafts_that_are_the_argmax_then_the_argmax():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3, V)), jnp.float32)
    argmax = np.asarray(jnp.argmax(logits, -1))
    drafts = np.stack(
        [
            argmax[0, :2],  # both right: both kept, then the argmax after them
            [argmax[1, 0], (argmax[1, 1] + 1) % V],  # the second is wrong: one kept, then the argmax there
            [(argmax[2, 0] + 1) % V, argmax[2, 1]],  # the first is wrong: nothing kept after it
        ]
    )
    out = accept(jnp.asarray(drafts), logits, _inputs(3, 3), _params(3, temperature=0.0))
    assert list(np.asarray(out.counts)) == [3, 2, 1]
    tokens = np.asarray(out.tokens)
    assert list(tokens[0]) == list(argmax[0])
    assert list(tokens[1]) == [argmax[1, 0], argmax[1, 1], -1]
    assert list(tokens[2]) == [argmax[2, 0], -1, -1]


def test_a_row_keeps_no_more_tokens_than_its_length():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, V)), jnp.float32)
    argmax = np.asarray(jnp.argmax(logits, -1))
    out = accept(jnp.asarray(argmax[:, :2]), logits, _inputs(2, [2, 0]), _params(2, temperature=0.0))
    # Room for one draft (max_tokens): it and the token after it; a padding row (length 0) keeps nothing.
    assert list(np.asarray(out.counts)) == [2, 0]
    assert list(np.asarray(out.tokens)[0]) == [argmax[0, 0], argmax[0, 1], -1]


def _sampled_run(p_logits: np.ndarray, drafts: np.ndarray, temperature: float = 1.0, top_k: int = -1):
    """One row per draft (one draft each, every row its own seed): the first token each row keeps, and how many."""
    n = len(drafts)
    params = _params(n, temperature=temperature, top_k=top_k, seed=list(range(n)))
    logits = jnp.broadcast_to(jnp.asarray(p_logits, jnp.float32), (n, 2, V))
    out = accept(jnp.asarray(drafts[:, None], jnp.int32), logits, _inputs(n, 2), params)
    return np.asarray(out.tokens)[:, 0], np.asarray(out.counts)


def _model_distribution(p_logits: np.ndarray, temperature: float = 1.0, top_k: int = -1) -> np.ndarray:
    _, filtered = processed_logits(jnp.asarray(p_logits[:1], jnp.float32), _params(1, temperature, top_k))
    return np.asarray(jax.nn.softmax(filtered[0]), np.float64)


@pytest.mark.parametrize("draw", ["one token", "uniform"])
def test_rejection_sampling_keeps_the_models_distribution(draw):
    """Whatever the drafts are (always the same token, or tokens unrelated to the model), the first kept token
    follows the model's distribution, and a draft d is kept with probability p(d)."""
    rng = np.random.default_rng(3)
    p_logits = rng.normal(size=(2, V)) * 1.5
    n = 20000
    drafts = np.full(n, 2) if draw == "one token" else rng.integers(0, V, n)
    first, counts = _sampled_run(p_logits, drafts)
    p = _model_distribution(p_logits)
    observed = np.bincount(first, minlength=V)
    assert chisquare(observed, p / p.sum() * n).pvalue > 0.01, (observed, p * n)
    kept = np.mean(counts == 2)
    assert abs(kept - p[drafts].mean()) < 0.02, (kept, p[drafts].mean())


def test_rejection_sampling_keeps_the_filtered_distribution():
    """Temperature and top-k apply to the verification as the plain sampler applies them."""
    rng = np.random.default_rng(4)
    p_logits = rng.normal(size=(2, V)) * 2
    n = 20000
    first, _ = _sampled_run(p_logits, rng.integers(0, V, n), temperature=0.7, top_k=3)
    p = _model_distribution(p_logits, temperature=0.7, top_k=3)
    observed = np.bincount(first, minlength=V)
    assert observed[p == 0].sum() == 0  # nothing outside the top 3 comes out
    support = p > 0
    assert chisquare(observed[support], p[support] / p[support].sum() * n).pvalue > 0.01


def test_a_draft_the_model_is_sure_of_is_always_kept():
    p_logits = np.random.default_rng(5).normal(size=(2, V))
    best = int(np.argmax(p_logits[0]))
    first, counts = _sampled_run(p_logits, np.full(500, best), top_k=1)  # top-1 sampling: p(best) = 1
    assert (counts == 2).all() and (first == best).all()
