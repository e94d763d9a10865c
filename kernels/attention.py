"""Attention with a per-head sink over two key groups: keys shared by every query of a row (window ring,
the chunk itself, dense HCA entries) and keys selected per query (CSA top-k entries). K = V throughout. With a
`QueryRotation` (DeepSeek-V4's attention) the queries are RMS-normalised per head and rotated to their positions
first, and the output rotated back: a kernel does both in registers.

Letters: b rows, t queries, h heads, k head dim, s shared keys, j selected keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .norm import rms_norm
from .quant import one_layer
from .rope import apply_rope

F32 = jnp.float32


@functools.partial(jax.tree_util.register_dataclass, data_fields=["positions"], meta_fields=["freqs", "norm_eps"])
@dataclass(frozen=True)
class QueryRotation:
    """What DeepSeek-V4 does to a query head before attention and to its output after: q -> apply_rope(rms_norm(q,
    None, norm_eps), positions, freqs); out -> apply_rope(out, positions, freqs, inverse=True)."""

    positions: jax.Array  # [b, t], the queries' positions
    freqs: tuple[float, ...]  # per rotated pair of the last 2 * len(freqs) dims (kernels.rope)
    norm_eps: float


def sink_attention(
    q: jax.Array,  # [b, t, h, k]
    shared: jax.Array,  # [b, s, k]
    shared_mask: jax.Array,  # [b, t, s] bool
    sinks: Any,  # [h], or a LayerOf of a stack [layers, h]
    selected: jax.Array | None = None,  # [b, t, j, k]
    selected_mask: jax.Array | None = None,  # [b, t, j] bool
    rotation: QueryRotation | None = None,
) -> jax.Array:
    """softmax([q.K^T * k^-0.5, sink]) without the sink's column, times K. Returns [b, t, h, k] in q's dtype. `sinks`
    may be a `LayerOf` view of a stack; `rotation`: q normalised and rotated first, the output rotated back."""
    sinks = one_layer(sinks)
    if rotation is not None:
        q = apply_rope(rms_norm(q, None, rotation.norm_eps), rotation.positions[:, :, None], rotation.freqs)
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
    out = out.astype(q.dtype)
    if rotation is None:
        return out
    return apply_rope(out, rotation.positions[:, :, None], rotation.freqs, inverse=True)
