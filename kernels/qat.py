"""DeepSeek-V4.1's quantization-aware forward: the activations it was trained to see rounded, rounded the same way
in serving (values on the grids, kept in float: a cache of the model's dtype holds them exactly).

- window K=V vectors: FP8 e4m3 with one power-of-two (ue8m0) scale per 32 channels, RoPE dims included;
- compressed entries: FP4 e2m1 with one e4m3 scale per 16 channels;
- indexer queries and keys: FP4 e2m1 with one power-of-two scale per 32 channels.
Rounding is to nearest, ties to even, after clamping to the format's largest value. A width that is not a multiple
of the block (tiny test models) is left as it is, as the reference leaves it.

Letters: ... any leading axes, n blocks, c channels in a block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .quant import FP4_MAX, FP8_MAX, pow2_at_least

F32 = jnp.float32
FP8_KV_BLOCK = 32  # window K=V channels per scale
FP4_ENTRY_BLOCK = 16  # compressed-entry channels per scale
FP4_INDEX_BLOCK = 32  # indexer query and key channels per scale


def _blocks(x: jax.Array, block: int) -> jax.Array:
    return x.astype(F32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fake_fp8(x: jax.Array, block: int = FP8_KV_BLOCK) -> jax.Array:
    """x rounded to e4m3 with a power-of-two scale per `block` channels (the block's largest magnitude, at least
    1e-4, fits), in x's dtype."""
    if x.shape[-1] % block:
        return x
    blocks = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), 1e-4)
    scale = pow2_at_least(amax * F32(1.0 / FP8_MAX))
    codes = jnp.clip(blocks / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return (codes.astype(F32) * scale).reshape(x.shape).astype(x.dtype)


def fake_fp4(x: jax.Array, block: int, e4m3_scales: bool = False) -> jax.Array:
    """x rounded to e2m1 with one scale per `block` channels: a power of two (`e4m3_scales` False) or an e4m3 value
    (True) so that the block's largest magnitude maps to at most 6. In x's dtype."""
    if x.shape[-1] % block:
        return x
    blocks = _blocks(x, block)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    if e4m3_scales:
        scale = (jnp.maximum(amax, 6.0 * 2.0**-9) / FP4_MAX).astype(jnp.float8_e4m3fn).astype(F32)
    else:
        scale = pow2_at_least(jnp.maximum(amax, 6.0 * 2.0**-126) * F32(1.0 / FP4_MAX))
    codes = jnp.clip(blocks / scale, -FP4_MAX, FP4_MAX).astype(jnp.float4_e2m1fn)
    return (codes.astype(F32) * scale).reshape(x.shape).astype(x.dtype)
