"""Interleaved rotary embedding: the reference of the rotation the attention kernel applies to its queries and
output, and the model's own for keys and compressed entries.

Rotating the last r = 2 * len(freqs) dims of x [..., k] as interleaved pairs (x[2i], x[2i+1]) by angles
positions * freqs[i] is, per element, x[c] * cos[c] + x[c ^ 1] * sin[c] (c ^ 1 the other element of c's pair): with
tables cos = 1, sin = 0 over the first k - r dims, and over the rotated ones cos[2i] = cos[2i+1] = cos(angle_i),
sin[2i] = -sin(angle_i), sin[2i+1] = +sin(angle_i). The model's maths and a kernel's in-register rotation are that
one formula over the same tables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def rotation_tables(
    positions: jax.Array, freqs: np.ndarray | tuple[float, ...], width: int
) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [*positions.shape, width] float32 such that rotating x [..., width] is
    x * cos + swap_pairs(x) * sin (the module's formula); angles positions * freqs in float32."""
    freqs = np.asarray(freqs)
    r = 2 * freqs.shape[0]
    angles = positions.astype(F32)[..., None] * jnp.asarray(freqs, F32)  # [..., R/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    lead = positions.shape
    cos = jnp.concatenate([jnp.ones((*lead, width - r), F32), jnp.repeat(cos, 2, axis=-1)], axis=-1)
    sin = jnp.concatenate([jnp.zeros((*lead, width - r), F32), jnp.stack([-sin, sin], axis=-1).reshape(*lead, r)], -1)
    return cos, sin


def swap_pairs(x: jax.Array) -> jax.Array:
    """x with the two elements of each pair (x[2i], x[2i+1]) of its last axis exchanged."""
    return x.reshape(*x.shape[:-1], -1, 2)[..., ::-1].reshape(x.shape)


def apply_rope(
    x: jax.Array, positions: jax.Array, freqs: np.ndarray | tuple[float, ...], inverse: bool = False
) -> jax.Array:
    """Rotate the last 2*len(freqs) dims of x as interleaved pairs (x[2i], x[2i+1]); `inverse` rotates back.

    x: [..., k]; positions broadcast against x's leading dims (x.shape[:-1] after any head axes are
    accounted for by the caller). float32 maths, result in x's dtype.
    """
    cos, sin = rotation_tables(positions, freqs, x.shape[-1])
    xf = x.astype(F32)
    return (xf * cos + swap_pairs(xf) * (-sin if inverse else sin)).astype(x.dtype)
