"""kernels.pallas.mhc: the Pallas mHC collapse (interpret=True on CPU) equals the reference kernels.mhc.hc_pre for
decode- and prefill-shaped inputs, row counts that are not a multiple of the block, widths that are not a multiple
of the splits, bfloat16 and float32 streams, peaked and flat mixing logits, with and without the block's input norm
folded in; its comb is doubly stochastic; it refuses a stream count Triton cannot block. Compiling it for a GPU:
tests/test_plan_target.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.mhc import hc_head as reference_head
from jaxserve.kernels.mhc import hc_pre as reference
from jaxserve.kernels.pallas.mhc import hc_head, hc_pre
from jaxserve.kernels.quant import LayerOf

EPS = dict(norm_eps=1e-6, hc_eps=1e-6, iters=20)
# Float32 sums over up to n * d = 2048 terms, split and re-associated; the Sinkhorn loop then compounds a few ulps.
TOL = dict(rtol=2e-5, atol=2e-6)


def _inputs(lead: tuple[int, ...], n: int, d: int, dtype, comb_scale: float, seed: int):
    rng = np.random.default_rng(seed)
    m = 2 * n + n * n
    h = jnp.asarray(rng.normal(size=(*lead, n, d)), dtype)
    fn = jnp.asarray(rng.normal(size=(n * d, m)) / np.sqrt(n * d), jnp.float32)
    base = jnp.asarray(rng.normal(size=(m,)), jnp.float32)
    scale = jnp.asarray([1.0, 0.5, comb_scale], jnp.float32)
    return h, fn, base, scale


def _norm(d: int, seed: int) -> jax.Array:
    return jnp.asarray(1.0 + 0.5 * np.random.default_rng(seed).normal(size=(d,)), jnp.float32)


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize(
    "lead, d, dtype, comb_scale",
    [
        ((1, 1), 64, jnp.float32, 1.0),  # one decode row
        ((8, 1), 96, jnp.bfloat16, 8.0),  # a decode batch; d not a power of two; peaked comb logits
        ((3, 37), 128, jnp.float32, 0.01),  # prefill-shaped, 111 rows; flat comb logits
        ((130,), 512, jnp.bfloat16, 1.0),  # more rows than two blocks, more columns than one split
    ],
)
def test_pallas_hc_pre_equals_the_reference(lead, d, dtype, comb_scale, normed):
    h, fn, base, scale = _inputs(lead, 4, d, dtype, comb_scale, seed=d + len(lead))
    norm = _norm(d, seed=d) if normed else None
    want = reference(h, fn, base, scale, norm, **EPS)
    got = hc_pre(h, fn, base, scale, norm, interpret=True, block_cols=32, split_cols=128, **EPS)
    for name, g, w in zip(("x", "post", "comb"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if name == "x" and dtype == jnp.bfloat16:  # float32 sums rounded once to bfloat16: one ulp apart at most
            # (atol: where the streams' weighted sum cancels to near zero, an ulp of the terms, not of the sum).
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2**-7, atol=1e-4)
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL, err_msg=name)
    np.testing.assert_allclose(np.asarray(got[2]).sum(axis=-2), 1.0, atol=1e-3)  # columns, normalised last


def test_the_default_tiles_match_the_reference_at_flash_width():
    h, fn, base, scale = _inputs((2, 1), 4, 4096, jnp.bfloat16, 1.0, seed=7)
    norm = _norm(4096, seed=7)
    want = reference(h, fn, base, scale, norm, **EPS)
    got = hc_pre(h, fn, base, scale, norm, interpret=True, **EPS)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=2**-7, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), **TOL)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), **TOL)


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize(
    "lead, d, dtype", [((1, 1), 64, jnp.float32), ((8, 1), 96, jnp.bfloat16), ((130,), 512, jnp.bfloat16)]
)
def test_pallas_hc_head_equals_the_reference(lead, d, dtype, normed):
    """The final collapse (pre weights alone: fn [n * d, n], base [n], scale [1]) and the final norm, in the same two
    kernels; as LayerOf views too."""
    h, fn, base, scale = _inputs(lead, 4, d, dtype, 1.0, seed=d)
    fn, base, scale = fn[:, :4], base[:4], scale[:1]
    norm = _norm(d, seed=d) if normed else None
    want = np.asarray(reference_head(h, fn, base, scale, norm, norm_eps=1e-6, hc_eps=1e-6), np.float32)
    got = hc_head(h, fn, base, scale, norm, interpret=True, block_cols=32, split_cols=128, norm_eps=1e-6, hc_eps=1e-6)
    assert got.shape == (*lead, d) and got.dtype == dtype
    tol = dict(rtol=2**-7, atol=1e-4) if dtype == jnp.bfloat16 else TOL
    np.testing.assert_allclose(np.asarray(got, np.float32), want, **tol)
    views = [LayerOf(jnp.stack([w, w + 1.0]), jnp.int32(0)) for w in (fn, base, scale)]
    norms = [] if norm is None else [LayerOf(jnp.stack([norm, norm * 2.0]), jnp.int32(0))]
    got = hc_head(h, *views, *norms, interpret=True, block_cols=32, split_cols=128, norm_eps=1e-6, hc_eps=1e-6)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, **tol)


@pytest.mark.parametrize("n", [2, 3])
def test_a_stream_count_triton_cannot_block_is_refused(n):
    h, fn, base, scale = _inputs((2,), n, 32, jnp.float32, 1.0, seed=0)
    with pytest.raises(ValueError, match="stream count"):
        hc_pre(h, fn, base, scale, interpret=True, **EPS)


def test_a_layer_of_stacked_weights_is_read_in_place():
    """The model passes a looped segment's hyper-connections as `LayerOf` views of their stacks (three layers here;
    the layer a traced index): the kernels read that layer, as the reference's slice does."""
    layers = [(*_inputs((4, 1), 4, 64, jnp.bfloat16, 1.0, seed=s), _norm(64, seed=s)) for s in range(3)]
    h = layers[0][0]
    fn, base, scale, norm = (jnp.stack([weights[i] for weights in layers]) for i in (1, 2, 3, 4))
    pick = jax.jit(
        lambda h, fn, base, scale, norm, layer: hc_pre(
            h, *(LayerOf(w, layer) for w in (fn, base, scale, norm)), interpret=True, **EPS
        )
    )
    got = pick(h, fn, base, scale, norm, jnp.int32(1))
    want = reference(h, *layers[1][1:], **EPS)
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=2**-7, atol=1e-4)
    with pytest.raises(ValueError, match="all LayerOf views or all plain"):
        hc_pre(h, LayerOf(fn, 1), base[1], scale[1], interpret=True, **EPS)
    with pytest.raises(ValueError, match="all LayerOf views or all plain"):
        hc_pre(h, LayerOf(fn, 1), LayerOf(base, 1), LayerOf(scale, 1), norm[1], interpret=True, **EPS)
