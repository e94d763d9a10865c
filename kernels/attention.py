"""Attention with a per-head sink over two key groups: keys shared by every query of a row (window ring,
the chunk itself, dense HCA entries) and keys selected per query (CSA top-k entries). K = V throughout.

Letters: b rows, t queries, h heads, k head dim, s shared keys, j selected keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def sink_attention(
    q: jax.Array,  # [b, t, h, k]
    shared: jax.Array,  # [b, s, k]
    shared_mask: jax.Array,  # [b, t, s] bool
    sinks: jax.Array,  # [h]
    selected: jax.Array | None = None,  # [b, t, j, k]
    selected_mask: jax.Array | None = None,  # [b, t, j] bool
) -> jax.Array:
    """softmax([q.K^T * k^-0.5, sink]) without the sink's column, times K. Returns [b, t, h, k] in q's dtype."""
    scale = q.shape[-1] ** -0.5
    qf = q.astype(F32)
    neg = jnp.finfo(F32).min
    logits = [jnp.where(shared_mask[:, :, None, :], jnp.einsum("bthk,bsk->bths", qf, shared.astype(F32)) * scale, neg)]
    if selected is not None:
        assert selected_mask is not None, "selected keys come with their mask"
        sel_logits = jnp.einsum("bthk,btjk->bthj", qf, selected.astype(F32)) * scale
        logits.append(jnp.where(selected_mask[:, :, None, :], sel_logits, neg))
    sink = jnp.broadcast_to(sinks.astype(F32)[None, None, :, None], (*q.shape[:3], 1))
    all_logits = jnp.concatenate(logits + [sink], axis=-1)
    probs = jax.nn.softmax(all_logits, axis=-1)
    s = shared.shape[1]
    out = jnp.einsum("bths,bsk->bthk", probs[..., :s], shared.astype(F32))
    if selected is not None:
        out = out + jnp.einsum("bthj,btjk->bthk", probs[..., s:-1], selected.astype(F32))
    return out.astype(q.dtype)
