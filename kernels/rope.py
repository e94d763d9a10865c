"""Interleaved rotary embedding: the reference of the rotation the attention kernel applies to its queries and
output, and the model's own for keys and compressed entries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def apply_rope(x: jax.Array, positions: jax.Array, freqs: np.ndarray, inverse: bool = False) -> jax.Array:
    """Rotate the last 2*len(freqs) dims of x as interleaved pairs (x[2i], x[2i+1]).

    x: [..., k]; positions broadcast against x's leading dims (x.shape[:-1] after any head axes are
    accounted for by the caller). float32 maths, result in x's dtype.
    """
    r = 2 * freqs.shape[0]
    angles = positions.astype(F32)[..., None] * jnp.asarray(freqs, F32)  # [..., R/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-r], x[..., -r:].astype(F32)
    a, b = rope[..., 0::2], rope[..., 1::2]
    rotated = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rope.shape)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)
