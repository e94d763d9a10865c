"""RMS normalisation: the reference of the norms the kernels fold into their loads (the mHC collapse's block-input
norm, a projection's input norm) and the model's own everywhere else."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) [* weight], in float32, cast back to x's dtype."""
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(F32)
    return y.astype(x.dtype)
