"""Block-scaled low-precision weights, kept in their storage form on the devices and decoded inside the matmul.

A `Quantized` weight is its codes plus one power-of-two scale per block:
- FP8: e4m3 codes of the weight's own shape (DeepSeek's release: 128x128 blocks);
- FP4: e2m1 codes packed two per byte along axis -2, the input axis of an input-major `[..., in, out]` weight
  (low nibble = the even element), blocks of 32 along that axis (the release's 1x32 per output row).
Scales are ue8m0 bytes (the value is 2^(u - 127)), one per block: `ceil(n / block)` along each blocked axis.
`blocks` counts elements of the decoded weight along its trailing axes; any leading axes (a stack of layers, of
experts) have a block of 1, so stacking weights never changes their blocks.

These are the pure-JAX references: `dequantize` is elementwise work that XLA fuses into the consuming dot, and
`einsum` / the grouped expert matmul are where a GPU kernel that reads the codes itself would take over.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from .norm import rms_norm

FP8 = "fp8_e4m3"
FP4 = "fp4_e2m1"
FORMATS = (FP8, FP4)
FP8_MAX = 448.0  # largest finite e4m3fn
FP4_MAX = 6.0  # largest e2m1
SCALE_BIAS = 127  # ue8m0: 2^(u - 127)
DECODE_PASS_BYTES = 16 << 20  # decoded weight one pass of a reference matmul may hold (it never decodes all of a
# bigger weight at once: Flash's expert stacks, its wider projections)
F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Quantized:
    codes: Any  # FP8: float8_e4m3fn [..., n]; FP4: uint8 [..., in / 2, out]
    scales: Any  # uint8 ue8m0 exponents, ceil(n / block) along each trailing axis
    format: str = dataclasses.field(metadata=dict(static=True))
    blocks: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # decoded elements per scale

    @property
    def shape(self) -> tuple[int, ...]:
        """The decoded weight's shape."""
        return logical_shape(self.format, tuple(self.codes.shape))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerOf:
    """Layer `layer` of a stack of one weight's layers (`stack` [layers, ...]), not sliced out of it: a kernel that can
    reads that layer in place (kernels.pallas.block_scaled_matmul, as the expert kernel reads a layer's experts;
    kernels.pallas.mhc, a hyper-connection's weights), where slicing it out first would copy the layer's weight on every
    step; anything else takes the slice (`one_layer`)."""

    stack: Any  # Quantized or array [layers, ...] (Any: vmap's in_axes give a LayerOf of axes)
    layer: Any  # int32 scalar


def layer_stacks(*weights: Any) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Plain weights as a kernel reads them in place: their stacks of layers and the layer's index [1] int32 (`LayerOf`
    views: their stacks, all of one layer; plain weights: stacks of one)."""
    views = [w for w in weights if isinstance(w, LayerOf)]
    if not views:
        return tuple(w[None] for w in weights), jnp.zeros((1,), jnp.int32)
    if len(views) < len(weights):
        raise ValueError("weights a kernel reads in place together must be all LayerOf views or all plain")
    return tuple(w.stack for w in views), jnp.reshape(views[0].layer, (1,)).astype(jnp.int32)


def one_layer(w: Any) -> Any:
    """A weight as one layer's: a LayerOf sliced out of its stack, anything else as it is."""
    return take(w.stack, w.layer) if isinstance(w, LayerOf) else w


def logical_shape(fmt: str, codes_shape: tuple[int, ...]) -> tuple[int, ...]:
    if fmt == FP4:
        return (*codes_shape[:-2], 2 * codes_shape[-2], codes_shape[-1])
    return codes_shape


def codes_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if fmt == FP4:
        if len(shape) < 2 or shape[-2] % 2:
            raise ValueError(f"FP4 packs pairs along axis -2, which needs an even size; got shape {list(shape)}")
        return (*shape[:-2], shape[-2] // 2, shape[-1])
    if fmt != FP8:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {FORMATS}")
    return shape


def scales_shape(shape: tuple[int, ...], blocks: tuple[int, ...]) -> tuple[int, ...]:
    lead = len(shape) - len(blocks)
    return (*shape[:lead], *(-(-n // b) for n, b in zip(shape[lead:], blocks)))


def codes_dtype(fmt: str):
    return jnp.float8_e4m3fn if fmt == FP8 else jnp.uint8


def expand_scales(scales: jax.Array, blocks: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    """One scale per block -> one per element of `shape` (partial last blocks cut off)."""
    lead = len(shape) - len(blocks)
    for i, b in enumerate(blocks):
        if b > 1:
            scales = jnp.repeat(scales, b, axis=lead + i, total_repeat_length=shape[lead + i])
    return scales


def scale_values(scales: jax.Array) -> jax.Array:
    """ue8m0 bytes -> float32 powers of two (255 is NaN, as the format says)."""
    return jax.lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu).astype(F32)


def fp4_values(codes: jax.Array) -> jax.Array:
    """uint8 nibbles (0..15) -> the e2m1 values they code, float32."""
    return jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn).astype(F32)


def dequantize(w: Quantized, dtype: Any) -> jax.Array:
    """The decoded weight, in `dtype` (exact: codes times a power of two fit bfloat16 as well as float32)."""
    if w.format == FP4:
        low, high = fp4_values(w.codes & 0xF), fp4_values(w.codes >> 4)
        values = jnp.stack([low, high], axis=-2).reshape(w.shape)  # [.., k, 2, out]: element 2k, then 2k+1
    else:
        values = w.codes.astype(F32)
    return (values * expand_scales(scale_values(w.scales), w.blocks, w.shape)).astype(dtype)


def dense(w: Any, dtype: Any) -> jax.Array:
    """A weight as a plain array: quantized ones decoded to `dtype`, plain ones as they are."""
    return dequantize(w, dtype) if isinstance(w, Quantized) else w


def pass_rows(n: int, unit: int, bytes_per_row: int) -> int:
    """How many of `n` rows one pass decodes: all when they fit DECODE_PASS_BYTES, else the most that fit, a multiple
    of `unit` (whole scale blocks) that divides `n`; all when no such cut exists."""
    if n * bytes_per_row <= DECODE_PASS_BYTES:
        return n
    fits = max(1, DECODE_PASS_BYTES // bytes_per_row)
    cuts = [size for size in range(unit, min(fits, n) + 1, unit) if n % size == 0]
    return cuts[-1] if cuts else n


def _contracts_first_axis(spec: str) -> bool:
    """Whether an explicit two-operand `spec` sums x's last axis against w's first (and nothing else uses it)."""
    spec = spec.replace(" ", "")
    if "->" not in spec or "..." in spec:
        return False
    inputs, out = spec.split("->")
    operands = inputs.split(",")
    if len(operands) != 2 or not all(operands):
        return False
    x_letters, w_letters = operands
    return x_letters[-1] == w_letters[0] and w_letters[0] not in out


def einsum(spec: str, x: jax.Array, w: Any, *, norm: Any = None, norm_eps: float = 0.0, **kwargs) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a plain or a quantized weight, decoded in x's dtype inside the computation.
    `norm` (an array or a `LayerOf`) normalises x first, `rms_norm(x, norm, norm_eps)`: the projection's input norm,
    which a kernel folds into its loads of x.

    An FP8 weight whose decoded form would pass DECODE_PASS_BYTES (Flash's wider projections) and whose first axis
    the spec contracts with x's last is decoded a slice of whole scale blocks of that axis at a time, the partial
    products summed in float32: never as a whole tensor. A `LayerOf` is sliced out of its stack first."""
    if norm is not None:
        x = rms_norm(x, one_layer(norm), norm_eps)
    w = one_layer(w)
    if not isinstance(w, Quantized):
        return jnp.einsum(spec, x, w, **kwargs)
    n = w.shape[0]
    rows = n
    if w.format == FP8 and _contracts_first_axis(spec):
        rows = pass_rows(n, w.blocks[0], math.prod(w.shape[1:]) * jnp.dtype(x.dtype).itemsize)
    if rows == n:
        return jnp.einsum(spec, x, dense(w, x.dtype), **kwargs)
    block = w.blocks[0]

    def one_pass(i: jax.Array, acc: jax.Array) -> jax.Array:
        codes = jax.lax.dynamic_slice_in_dim(w.codes, i * rows, rows, axis=0)
        scales = jax.lax.dynamic_slice_in_dim(w.scales, i * (rows // block), rows // block, axis=0)
        x_slice = jax.lax.dynamic_slice_in_dim(x, i * rows, rows, axis=x.ndim - 1)
        part = dense(Quantized(codes, scales, w.format, w.blocks), x.dtype)
        return acc + jnp.einsum(spec, x_slice, part, preferred_element_type=F32)

    shape = jax.eval_shape(lambda: jnp.einsum(spec, x, jnp.zeros(w.shape, x.dtype), **kwargs))
    total = jax.lax.fori_loop(0, n // rows, one_pass, jnp.zeros(shape.shape, F32))
    return total.astype(shape.dtype)


def take(w: Any, index: jax.Array) -> Any:
    """`w[index]` along the leading axis, codes and scales alike (e.g. the experts of some rows)."""
    return jax.tree.map(lambda a: a[index], w)


# ---- quantizing (tests, benchmarks' random weights, the checkpoint writer) ------------------------------------------


def _block_amax(w: jax.Array, blocks: tuple[int, ...]) -> jax.Array:
    """max |w| over each block (partial blocks at the ends included)."""
    lead = len(w.shape) - len(blocks)
    a = jnp.abs(w.astype(F32))
    pad = [(0, 0)] * lead + [(0, -n % b) for n, b in zip(w.shape[lead:], blocks)]
    a = jnp.pad(a, pad)
    split = list(a.shape[:lead])
    for n, b in zip(a.shape[lead:], blocks):
        split += [n // b, b]
    return a.reshape(split).max(axis=tuple(lead + 2 * i + 1 for i in range(len(blocks))))


def _pow2_exponent_at_least(x: jax.Array) -> jax.Array:
    """The exponent e of the smallest power of two 2^e >= x (x > 0), exactly (no log2 rounding)."""
    mantissa, exponent = jnp.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    return jnp.where(mantissa == 0.5, exponent - 1, exponent)


def pow2_at_least(x: jax.Array) -> jax.Array:
    """The smallest power of two >= x (x > 0, float32), exactly: a ue8m0 scale."""
    return jnp.ldexp(jnp.ones((), F32), _pow2_exponent_at_least(x))


def quantize(w: jax.Array, fmt: str, blocks: tuple[int, ...]) -> Quantized:
    """Round `w` to `fmt` with power-of-two block scales chosen so the block's largest value fits (round to nearest
    even; FP4 pairs packed along axis -2)."""
    codes_shape(fmt, tuple(w.shape))  # validates the format and the packing axis
    top, floor = (FP8_MAX, 1e-4) if fmt == FP8 else (FP4_MAX, 1e-12)
    exponent = jnp.clip(
        _pow2_exponent_at_least(jnp.maximum(_block_amax(w, blocks), floor) / top), -SCALE_BIAS, SCALE_BIAS
    )
    scaled = w.astype(F32) / expand_scales(jnp.ldexp(jnp.ones((), F32), exponent), blocks, tuple(w.shape))
    scales = (exponent + SCALE_BIAS).astype(jnp.uint8)
    if fmt == FP8:
        return Quantized(scaled.astype(jnp.float8_e4m3fn), scales, fmt, tuple(blocks))
    nibbles = jax.lax.bitcast_convert_type(scaled.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8)
    packed = nibbles[..., 0::2, :] | (nibbles[..., 1::2, :] << 4)
    return Quantized(packed, scales, fmt, tuple(blocks))
