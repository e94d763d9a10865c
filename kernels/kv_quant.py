"""FP8 storage of KV vectors: e4m3 codes with power-of-two block scales, and the RoPE dims kept in bfloat16.

An `Fp8KV` holds vectors `[..., width]` as three leaves that share the leading axes, so gathering or scattering
rows of a store is a `jax.tree.map` over them:
- `codes [..., n]` e4m3: the first n dims, each block of `block` consecutive dims divided by its scale;
- `scales [..., n / block]`: one power of two per block, as a ue8m0 byte (uint8, 2^(u - 127), as the weights'
  scales in jaxserve.kernels.quant) or as its float32 value;
- `rope [..., width - n]` bfloat16: the trailing RoPE dims, or None when every dim is quantized.

The scale of a block is the smallest power of two that fits the block's amax (floored at 1e-4) into e4m3's 448:
the rule of jaxserve.kernels.quant.quantize, and the one DeepSeek-V4's training simulated on its window and
compressed KV. Decoding is exact in bfloat16: a 4-bit-significand code times a power of two.

These are the pure-JAX references: a GPU kernel would read the codes inside the attention instead of decoding the
rows first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from .quant import FP8, quantize, scale_values

F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8KV:
    codes: Any  # float8_e4m3fn [..., n]
    scales: Any  # [..., n / block]: uint8 ue8m0 exponents or float32 powers of two
    rope: Any = None  # bfloat16 [..., width - n], the RoPE dims; None: none kept apart

    @property
    def block(self) -> int:
        return self.codes.shape[-1] // self.scales.shape[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        """The decoded vectors' shape."""
        rope = 0 if self.rope is None else self.rope.shape[-1]
        return (*self.codes.shape[:-1], self.codes.shape[-1] + rope)


def quantize_kv(x: jax.Array, block: int, rope_dim: int, scale_dtype: Any) -> Fp8KV:
    """`x [..., width]` as codes of its first `width - rope_dim` dims in blocks of `block` (which must divide them),
    scales of `scale_dtype` (uint8 or float32), and its last `rope_dim` dims in bfloat16 (none if 0)."""
    n = x.shape[-1] - rope_dim
    if n % block:
        raise ValueError(f"a block of {block} does not divide the {n} quantized dims")
    with jax.named_scope("kv_quantize"):
        q = quantize(x[..., :n], FP8, (block,))
        scales = q.scales if jnp.dtype(scale_dtype) == jnp.uint8 else scale_values(q.scales)
        rope = x[..., n:].astype(jnp.bfloat16) if rope_dim else None
        return Fp8KV(q.codes, scales, rope)


def dequantize_kv(kv: Fp8KV, dtype: Any) -> jax.Array:
    """The vectors `[..., width]` in `dtype`."""
    with jax.named_scope("kv_dequantize"):
        scales = scale_values(kv.scales) if kv.scales.dtype == jnp.uint8 else kv.scales.astype(F32)
        values = (kv.codes.astype(F32) * jnp.repeat(scales, kv.block, axis=-1)).astype(dtype)
        return values if kv.rope is None else jnp.concatenate([values, kv.rope.astype(dtype)], axis=-1)


def encode(values: jax.Array, like: Any) -> Any:
    """`values` in the storage form of `like` (a plain array: its dtype; an Fp8KV: its blocks, scales and RoPE
    width)."""
    if not isinstance(like, Fp8KV):
        return values.astype(like.dtype)
    rope_dim = 0 if like.rope is None else like.rope.shape[-1]
    return quantize_kv(values, like.block, rope_dim, like.scales.dtype)


def decode(stored: Any, dtype: Any) -> jax.Array:
    """Stored vectors (a plain array or an Fp8KV) in `dtype`."""
    return dequantize_kv(stored, dtype) if isinstance(stored, Fp8KV) else stored.astype(dtype)
