"""mHC, DeepSeek-V4's hyper-connections: the collapse of the residual streams into one sublayer input, with the
Sinkhorn normalisation of the residual-mixing matrices.

Letters: ... any leading axes (rows, tokens), n the hyper-connection streams, d embed, x the flattened streams
(n * d), m the mixes (2n + n^2: pre | post | comb, the comb row-major n x n).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .norm import rms_norm
from .quant import one_layer

F32 = jnp.float32


def hc_mixes(h: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """The unweighted-RMS-normalised projection of the flattened streams: h [..., n, d], fn [n * d, m] -> [..., m]
    float32."""
    flat = h.reshape(*h.shape[:-2], -1).astype(F32)
    inv_rms = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)
    return jnp.einsum("...x,xm->...m", flat, fn.astype(F32)) * inv_rms


def hc_pre(
    h: jax.Array, fn: Any, base: Any, scale: Any, norm: Any = None, *, norm_eps: float, hc_eps: float, iters: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [..., n, d] -> (x [..., d] in h's dtype, post [..., n], comb [..., n, n]; both float32):
    mixes = hc_mixes(h, fn) * scale (per part) + base; pre = sigmoid(mixes_pre) + hc_eps, x = sum_n pre_n h_n;
    post = 2 sigmoid(mixes_post); comb = sinkhorn(mixes_comb). `norm` [d]: the block's input norm weight; given, x
    comes out RMS-normalised (`rms_norm(x, norm, norm_eps)`), as the block reads it. The weights (fn [n * d, m],
    base [m], scale [3], norm) may be `LayerOf` views of stacks (sliced here)."""
    pre, post, comb = hc_weights(h, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, iters=iters)
    return hc_collapse(h, pre, norm, norm_eps), post, comb


def hc_weights(
    h: jax.Array, fn: Any, base: Any, scale: Any, *, norm_eps: float, hc_eps: float, iters: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A site's three weight sets from the streams h [..., n, d] (float32): pre [..., n], post [..., n] and comb
    [..., n, n], as `hc_pre` defines them. DeepSeek-V4.1's single-pass mHC collapses with the `pre` of the site before
    (`hc_collapse`)."""
    fn, base, scale = (one_layer(a) for a in (fn, base, scale))
    n = h.shape[-2]
    mixes = hc_mixes(h, fn, norm_eps)
    base, scale = base.astype(F32), scale.astype(F32)
    pre = _pre_weights(mixes, base, scale, n, hc_eps)
    post = 2.0 * jax.nn.sigmoid(mixes[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = (mixes[..., 2 * n :] * scale[2] + base[2 * n :]).reshape(*mixes.shape[:-1], n, n)
    return pre, post, sinkhorn(comb_logits, iters, hc_eps)


def hc_head(h: jax.Array, fn: Any, base: Any, scale: Any, norm: Any = None, *, norm_eps: float, hc_eps: float):
    """The final collapse of the streams h [..., n, d] -> [..., d] in h's dtype: hc_pre's pre weights alone, no
    Sinkhorn (fn [n * d, n], base [n], scale [1]); normalised by the final norm `norm` [d] when given
    (`rms_norm(x, norm, norm_eps)`: what the LM head reads)."""
    fn, base, scale = (one_layer(a) for a in (fn, base, scale))
    pre = _pre_weights(hc_mixes(h, fn, norm_eps), base.astype(F32), scale.astype(F32), h.shape[-2], hc_eps)
    return hc_collapse(h, pre, norm, norm_eps)


def _pre_weights(mixes: jax.Array, base: jax.Array, scale: jax.Array, n: int, hc_eps: float) -> jax.Array:
    """The streams' weights in the collapse [..., n]: sigmoid of the first n mixes, scaled and shifted, plus hc_eps."""
    return jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + hc_eps


def hc_collapse(h: jax.Array, pre: jax.Array, norm: Any = None, norm_eps: float = 0.0) -> jax.Array:
    """x = sum_n pre_n h_n in h's dtype, RMS-normalised by `norm` (a weight or a `LayerOf`) when given."""
    x = jnp.einsum("...n,...nd->...d", pre, h.astype(F32)).astype(h.dtype)
    return x if norm is None else rms_norm(x, one_layer(norm), norm_eps)


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """[..., n, n] logits -> row softmax (+ eps), then alternate column / row normalisation towards a
    doubly-stochastic matrix: one column pass after the softmax and iters - 1 (row, column) passes. Float32."""

    def normalise_columns(m):
        return m / (jnp.sum(m, axis=-2, keepdims=True) + eps)

    def row_then_column(_, m):
        return normalise_columns(m / (jnp.sum(m, axis=-1, keepdims=True) + eps))

    comb = normalise_columns(jax.nn.softmax(logits.astype(jnp.float32), axis=-1) + eps)
    # A loop, not unrolled: 20 unrolled iterations per hyper-connection dominated XLA compile time.
    return jax.lax.fori_loop(0, iters - 1, row_then_column, comb)
