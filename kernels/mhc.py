"""mHC's Sinkhorn normalisation of the residual-mixing matrices (DeepSeek-V4's hyper-connections).

Letters: ... any leading axes (rows, tokens), n the hyper-connection streams (an n x n matrix per token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
