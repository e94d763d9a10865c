"""FP8 storage of KV vectors: e4m3 codes with power-of-two block scales, and the RoPE dims kept in bfloat16, packed
byte for byte into one uint8 row per vector.

An `Fp8KV` holds vectors `[..., width]` as one leaf, `packed [..., row_bytes]`, each row laid out as
- `n` bytes: the e4m3 codes of the first n dims, each block of `block` consecutive dims divided by its scale;
- the block scales, `n / block` of them: ue8m0 bytes (2^(u - 127), as the weights' scales in
  jaxserve.kernels.quant) or float32 values (4 bytes each, native byte order);
- the trailing `width - n` RoPE dims as bfloat16 (2 bytes each), none when every dim is quantized.
DeepSeek's FP8 KV layout (FlashMLA's, vLLM's `fp8_ds_mla`) packs an entry the same way: 448 codes, 64 RoPE dims, 7
scales. One leaf a store means one gather or scatter a read or write, where three leaves took three kernels each;
the layout (n, block, RoPE dims, scale type) is static, part of the pytree's structure.

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
import numpy as np

from .quant import FP8, quantize, scale_values

F32 = jnp.float32
U8 = jnp.uint8


def _codes_and_scales_bytes(n: int, block: int, scale_dtype: Any) -> int:
    return n + (n // block) * np.dtype(scale_dtype).itemsize


def _as_bytes(x: jax.Array) -> jax.Array:
    """`x [..., m]` as its bytes `[..., m * itemsize]` uint8 (a bitcast: no rounding)."""
    if x.dtype == U8:
        return x
    raw = jax.lax.bitcast_convert_type(x, U8)
    return raw.reshape(*x.shape[:-1], -1) if raw.ndim > x.ndim else raw


def _from_bytes(raw: jax.Array, dtype: Any) -> jax.Array:
    """The inverse of `_as_bytes`: `raw [..., m * itemsize]` uint8 as `[..., m]` of `dtype`."""
    size = np.dtype(dtype).itemsize
    if size > 1:
        raw = raw.reshape(*raw.shape[:-1], -1, size)
    return jax.lax.bitcast_convert_type(raw, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8KV:
    packed: Any  # uint8 [..., row_bytes]: each vector's codes, scales and RoPE dims (the module's layout)
    n: int = dataclasses.field(metadata=dict(static=True))  # the quantized dims
    block: int = dataclasses.field(metadata=dict(static=True))  # dims a scale covers
    rope_dim: int = dataclasses.field(metadata=dict(static=True))  # trailing bfloat16 dims
    scale_dtype: str = dataclasses.field(metadata=dict(static=True))  # "uint8" (ue8m0) or "float32"

    @staticmethod
    def row_bytes(n: int, block: int, rope_dim: int, scale_dtype: Any) -> int:
        return _codes_and_scales_bytes(n, block, scale_dtype) + 2 * rope_dim

    @classmethod
    def pack(cls, codes: jax.Array, scales: jax.Array, rope: jax.Array | None = None) -> Fp8KV:
        """The store of `codes [..., n]` e4m3, `scales [..., n / block]` (uint8 or float32) and `rope [..., r]`."""
        parts = [_as_bytes(codes), _as_bytes(scales)] + ([] if rope is None else [_as_bytes(rope.astype(jnp.bfloat16))])
        n = codes.shape[-1]
        return cls(
            jnp.concatenate(parts, axis=-1),
            n,
            n // scales.shape[-1],
            0 if rope is None else rope.shape[-1],
            np.dtype(scales.dtype).name,
        )

    @property
    def _scale_end(self) -> int:
        return _codes_and_scales_bytes(self.n, self.block, self.scale_dtype)

    @property
    def codes(self) -> jax.Array:
        return _from_bytes(self.packed[..., : self.n], jnp.float8_e4m3fn)

    @property
    def scales(self) -> jax.Array:
        return _from_bytes(self.packed[..., self.n : self._scale_end], self.scale_dtype)

    @property
    def rope(self) -> jax.Array | None:
        return _from_bytes(self.packed[..., self._scale_end :], jnp.bfloat16) if self.rope_dim else None

    @property
    def shape(self) -> tuple[int, ...]:
        """The decoded vectors' shape."""
        return (*self.packed.shape[:-1], self.n + self.rope_dim)


def quantize_kv(x: jax.Array, block: int, rope_dim: int, scale_dtype: Any) -> Fp8KV:
    """`x [..., width]` as codes of its first `width - rope_dim` dims in blocks of `block` (which must divide them),
    scales of `scale_dtype` (uint8 or float32), and its last `rope_dim` dims in bfloat16 (none if 0)."""
    n = x.shape[-1] - rope_dim
    if n % block:
        raise ValueError(f"a block of {block} does not divide the {n} quantized dims")
    with jax.named_scope("kv_quantize"):
        q = quantize(x[..., :n], FP8, (block,))
        scales = q.scales if jnp.dtype(scale_dtype) == U8 else scale_values(q.scales)
        return Fp8KV.pack(q.codes, scales, x[..., n:] if rope_dim else None)


def dequantize_kv(kv: Fp8KV, dtype: Any) -> jax.Array:
    """The vectors `[..., width]` in `dtype`."""
    with jax.named_scope("kv_dequantize"):
        scales = kv.scales
        scales = scale_values(scales) if scales.dtype == U8 else scales.astype(F32)
        values = (kv.codes.astype(F32) * jnp.repeat(scales, kv.block, axis=-1)).astype(dtype)
        rope = kv.rope
        return values if rope is None else jnp.concatenate([values, rope.astype(dtype)], axis=-1)


def encode(values: jax.Array, like: Any) -> Any:
    """`values` in the storage form of `like` (a plain array: its dtype; an Fp8KV: its blocks, scales and RoPE
    width)."""
    if not isinstance(like, Fp8KV):
        return values.astype(like.dtype)
    return quantize_kv(values, like.block, like.rope_dim, like.scale_dtype)


def decode(stored: Any, dtype: Any) -> jax.Array:
    """Stored vectors (a plain array or an Fp8KV) in `dtype`."""
    return dequantize_kv(stored, dtype) if isinstance(stored, Fp8KV) else stored.astype(dtype)
