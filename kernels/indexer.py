"""Lightning-indexer scoring and top-k selection of compressed entries (CSA layers).

Letters: b rows, t queries, h indexer heads, c indexer head dim, e compressed entries, j picks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def indexer_scores(q: jax.Array, head_weights: jax.Array, keys: jax.Array) -> jax.Array:
    """score(t, e) = sum_h w_h * relu(q_h . K_e) / sqrt(c): [b, t, e] float32 (q [b, t, h, c], head_weights
    [b, t, h], keys [b, e, c])."""
    scores = jax.nn.relu(jnp.einsum("bthc,bec->bthe", q.astype(F32), keys.astype(F32))) * q.shape[-1] ** -0.5
    return jnp.einsum("bthe,bth->bte", scores, head_weights.astype(F32))


def indexer_topk(
    q: jax.Array,  # [b, t, h, c], RoPE applied
    head_weights: jax.Array,  # [b, t, h], already scaled
    keys: jax.Array,  # [b, e, c], indexer entries of the row
    visible: jax.Array,  # [b, t, e] bool
    k: int,
) -> tuple[jax.Array, jax.Array]:
    """score(t, e) = sum_h w_h * relu(q_h . K_e) / sqrt(c); the top-k visible entries per query.

    Returns (indices [b, t, k] int32, valid [b, t, k] bool); picks that land on invisible entries are invalid.
    """
    return top_visible(indexer_scores(q, head_weights, keys), visible, k)


def top_visible(scores: jax.Array, visible: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k best `visible` entries of `scores` [..., e]: (indices [..., k] int32, valid [..., k] bool); picks that
    land on invisible entries (fewer than k visible) are invalid."""
    top_scores, top_idx = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)
    return top_idx.astype(jnp.int32), top_scores > -jnp.inf
