"""A matmul that reads FP8 (e4m3) weight codes and their ue8m0 block scales itself and decodes them tile by tile.

The maths. An FP8 `Quantized` weight W [K, N] (N = its trailing axes flattened) is `W[k, n] = code[k, n] * 2^(u - 127)`
with u the scale byte of the block holding (k, n). The contraction runs over K, so what a column n needs from the
scales is one byte per K block: `column_scales[kb, n]`, the scale of the block that holds rows
`kb * block_k ... (kb + 1) * block_k - 1` of column n. Then

    out[m, n] = sum_kb  sum_{k in block kb}  x[m, k] * (code[k, n] * 2^(column_scales[kb, n] - 127))

`einsum` builds that [ceil(K / block_k), N] byte array by repeating each scale over the columns its block covers (a
3-D [K, H, W] weight's (block_k, hb, wb) blocks become per-column bytes this way), 1/block_k the size of the codes.

The kernel. The grid is (M tiles, N tiles); program (i, j) reads the x rows [i*tm, (i+1)*tm) over all of K, the
codes of columns [j*tn, (j+1)*tn) over all of K, and those columns' scale bytes for every K block, and writes the
float32 [tm, tn] tile of the output. It loops over K in tiles of tk rows (a tile never straddles two scale blocks):
each step loads a [tm, tk] slice of x, a [tk, tn] slice of codes as e4m3, and the one [1, tn] row of scale bytes of
the block holding the slice; decodes the bytes to float32 powers of two from their bits (the byte is the biased
exponent; 0 is the denormal 2^-127 and 255 NaN, as ue8m0 says), multiplies the codes by them (exact for normal
results), casts the decoded tile to x's dtype (as the reference decodes the weight in x's dtype) and adds its dot
with the x slice to a float32 accumulator. So each code is read once per M tile and the decoded weight never exists
outside a tile.
Operands whose sizes are not multiples of the tiles are zero-padded outside the kernel and the result is cut: for a
weight whose K and N are multiples of the tiles (DeepSeek-V4's are multiples of 128) only the activations get padded;
any other weight is copied, padded, on every call.

Which kernel. `einsum` hands a weight whose scale blocks flatten to equal runs of columns (2-D weights with the
release's 128 x 128 blocks, wq_b's one-head-wide blocks, ...) to the grouped expert kernel as a stack of one expert
(`_expert_stack`): it masks the edges and decodes the block scales in registers, so the call needs no padded
copy of its activations and no per-column spread of its scales, two kernels fewer a projection on a GPU. The kernel
below takes the rest.

Verified here: the CPU `interpret=True` runs against `jaxserve.kernels.quant.einsum` (tests/
test_pallas_block_scaled_matmul.py). Unverified without a GPU: that the Triton lowering accepts the float8_e4m3fn
ref loads and their cast to float32 (jax allows it from compute capability 8.9, so H100/H200), the uint8 scale loads
(from a ref of ceil(K / block_k) rows, not a power of two; only [1, tn] rows of it are loaded) and the int32 ->
float32 bitcast of the decode, and that Triton keeps the denormal 2^-127 of byte 0 rather than flushing it (XLA on
CPU flushes denormals, so the tests cannot tell); also the speed of the default tiles.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..norm import rms_norm
from ..quant import FP8, LayerOf, Quantized, expand_scales, layer_stacks, one_layer
from ..quant import einsum as reference_einsum
from .grouped_matmul import grouped_matmul

F32 = jnp.float32
MIN_TILE = 16  # Triton's dot wants every operand dimension >= 16
ONE_SCALE = 127  # the ue8m0 byte of 1.0: what padded columns get (their codes are 0 anyway)
# x dtypes a Triton dot takes with float32 accumulation; any other x goes to the reference.
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
SPEC = re.compile(r"([a-zA-Z]+),([a-zA-Z]+)->([a-zA-Z]*)")


def _ue8m0_to_f32(scales: jax.Array) -> jax.Array:
    """ue8m0 bytes -> 2^(u - 127) in float32, from the bits: the byte is the float's biased exponent with a zero
    mantissa; 0 has no normal encoding, so it is the denormal 2^-127 (mantissa's top bit only); 255 is NaN."""
    u = scales.astype(jnp.int32)
    bits = jnp.where(u == 0, 1 << 22, jnp.where(u == 255, 0x7FC00000, u << 23))
    return jax.lax.bitcast_convert_type(bits, F32)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _k_tile(k: int, block_k: int, tile_k: int) -> int:
    """The rows of K one loop step takes: within one scale block (so one scale row serves it), at most `tile_k`."""
    if k <= block_k:  # a single scale block spans K: any tile does
        return min(tile_k, max(MIN_TILE, _pow2_at_least(k)))
    return min(tile_k, block_k & -block_k)  # the largest power of two dividing block_k


def _kernel(x_ref, codes_ref, scales_ref, out_ref, *, tile_k: int, block_k: int):
    def step(t, acc):
        rows = pl.ds(t * tile_k, tile_k)
        x = x_ref[:, rows]
        scale = _ue8m0_to_f32(scales_ref[pl.ds(jax.lax.div(t * tile_k, block_k), 1), :])  # [1, tn]
        w = (codes_ref[rows, :].astype(F32) * scale).astype(x.dtype)
        return acc + jnp.dot(x, w, preferred_element_type=F32)

    steps = x_ref.shape[1] // tile_k
    out_ref[...] = jax.lax.fori_loop(0, steps, step, jnp.zeros(out_ref.shape, F32))


def _pad_to(a: jax.Array, shape: tuple[int, ...], value: Any = 0) -> jax.Array:
    pads = [(0, n - m) for m, n in zip(a.shape, shape)]
    return jnp.pad(a, pads, constant_values=value) if any(p for _, p in pads) else a


@functools.partial(jax.jit, static_argnames=("block_k", "interpret", "tile_m", "tile_n", "tile_k"))
def fp8_matmul(
    x2d: jax.Array,
    codes: jax.Array,
    column_scales: jax.Array,
    block_k: int,
    *,
    interpret: bool = False,
    tile_m: int = 64,
    tile_n: int = 128,
    tile_k: int = 64,
) -> jax.Array:
    """`x2d [M, K] @ W [K, N]` in float32, W given as e4m3 `codes [K, N]` and ue8m0 `column_scales
    [ceil(K / block_k), N]` (row kb scales rows kb*block_k .. (kb+1)*block_k - 1 of each column).

    `tile_*` (powers of two >= 16) are upper bounds on the kernel's tiles; small operands get smaller tiles. K tiles
    must fit in one scale block, so when K spans several blocks, block_k needs a power-of-two factor >= 16.
    """
    m, k = x2d.shape
    n = codes.shape[1]
    if codes.dtype != jnp.float8_e4m3fn or codes.shape[0] != k:
        raise ValueError(f"codes must be float8_e4m3fn [{k}, N]; got {codes.dtype} {list(codes.shape)}")
    if column_scales.shape != (-(-k // block_k), n):
        raise ValueError(f"column_scales must be [ceil({k} / {block_k}), {n}]; got {list(column_scales.shape)}")
    for name, tile in (("tile_m", tile_m), ("tile_n", tile_n), ("tile_k", tile_k)):
        if tile < MIN_TILE or tile & (tile - 1):
            raise ValueError(f"{name} must be a power of two >= {MIN_TILE}; got {tile}")
    tm = min(tile_m, max(MIN_TILE, _pow2_at_least(m)))
    tn = min(tile_n, max(MIN_TILE, _pow2_at_least(n)))
    tk = _k_tile(k, block_k, tile_k)
    if tk < MIN_TILE:
        raise ValueError(f"block_k {block_k} has no power-of-two factor >= {MIN_TILE} to tile K={k} by")
    mp, kp, np_ = (-(-m // tm) * tm), (-(-k // tk) * tk), (-(-n // tn) * tn)
    # Padded K rows read the last real block's scale row (a tile's start is always < K), so no scale row is added.
    operands = (
        _pad_to(x2d, (mp, kp)),
        _pad_to(codes, (kp, np_)),
        _pad_to(column_scales, (column_scales.shape[0], np_), ONE_SCALE),
    )
    out = pl.pallas_call(
        functools.partial(_kernel, tile_k=tk, block_k=block_k),
        out_shape=jax.ShapeDtypeStruct((mp, np_), F32),
        grid=(mp // tm, np_ // tn),
        in_specs=[
            pl.BlockSpec((tm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((kp, tn), lambda i, j: (0, j)),
            pl.BlockSpec((column_scales.shape[0], tn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        interpret=interpret,
        # Triton's parameters also pick the Triton lowering (jax 0.10's pallas_call otherwise lowers to Mosaic GPU,
        # which would stage these whole-K blocks in shared memory).
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="fp8_block_scaled_matmul",
    )(*operands)
    return out[:m, :n]


def _is_matmul_spec(spec: str, x_ndim: int, w_ndim: int) -> bool:
    """Whether `spec` contracts x's last axis with w's first and outputs x's other axes, then w's, in order."""
    match = SPEC.fullmatch(spec.replace(" ", ""))
    if match is None:  # implicit output, ellipsis, more operands
        return False
    xs, ws, out = match.groups()
    return (
        len(xs) == x_ndim
        and len(ws) == w_ndim >= 2
        and xs[-1] == ws[0]
        and out == xs[:-1] + ws[1:]
        and len(set(out)) == len(out)
        and xs[-1] not in out
    )


def _full_blocks(w: Quantized) -> tuple[int, ...]:
    """`w.blocks` over all of w's axes (leading axes left out of `blocks` have a block of 1)."""
    return (1,) * (len(w.shape) - len(w.blocks)) + tuple(w.blocks)


def _column_scales(w: Quantized) -> jax.Array:
    """[ceil(K / block_k), N]: each K block's scale byte repeated over every column (of w's flattened trailing axes)
    that its block covers."""
    per_column = expand_scales(w.scales, (1, *_full_blocks(w)[1:]), (w.scales.shape[0], *w.shape[1:]))
    return per_column.reshape(per_column.shape[0], -1)


def _takes_kernel(spec: str, x: jax.Array, w: Any, kwargs: dict) -> bool:
    if not (isinstance(w, Quantized) and w.format == FP8 and x.dtype in KERNEL_DTYPES and x.size and w.codes.size):
        return False
    if set(kwargs) - {"preferred_element_type"} or not _is_matmul_spec(spec, x.ndim, w.codes.ndim):
        return False
    # fp8_matmul's K tiles must stay within one scale block and still be dot-sized.
    return _k_tile(w.shape[0], _full_blocks(w)[0], MIN_TILE) >= MIN_TILE


def einsum(
    spec: str, x: jax.Array, w: Any, *, norm: Any = None, norm_eps: float = 0.0, interpret: bool = False, **kwargs
) -> jax.Array:
    """`jaxserve.kernels.quant.einsum` with the FP8 kernel behind it where it applies: an FP8 weight contracted on its
    first axis with x's last, the output being x's other axes then w's, x float32, bfloat16 or float16. Everything
    else (a plain or FP4 weight, other specs or x dtypes, einsum options besides `preferred_element_type`, empty
    operands, K blocks no dot-sized tile fits in) is the reference's own result. A `LayerOf` whose blocks suit the
    grouped kernel is read in place from its stack (the stack's layers are its experts); otherwise it is sliced.
    The input norm (`norm`, a weight or a `LayerOf`) is folded into the grouped kernel's loads; before the other
    kernel it is the reference's."""
    stack, layers, layer, one = _layers(w)
    if not _takes_kernel(spec, x, one, kwargs):
        return reference_einsum(spec, x, w, norm=norm, norm_eps=norm_eps, **kwargs)
    k = one.shape[0]
    dtype = kwargs.get("preferred_element_type") or x.dtype
    experts = _expert_stack(stack, layers, one)
    if experts is not None:
        rows = x.reshape(-1, k)
        sizes = jnp.full((1,), rows.shape[0], jnp.int32)
        x_norm = None
        if norm is not None:
            (norm_stack,), norm_layer = layer_stacks(norm)
            x_norm = (norm_stack, norm_layer)
        out = grouped_matmul(
            rows,
            experts,
            sizes,
            layer,
            interpret=interpret,
            out_dtype=dtype,
            every_row_grouped=True,
            x_norm=x_norm,
            norm_eps=norm_eps,
        )
        return out.reshape(*x.shape[:-1], *one.shape[1:])
    if norm is not None:
        x = rms_norm(x, one_layer(norm), norm_eps)
    w = one_layer(w)
    out = fp8_matmul(
        x.reshape(-1, k), w.codes.reshape(k, -1), _column_scales(w), _full_blocks(w)[0], interpret=interpret
    )
    return out.reshape(*x.shape[:-1], *w.shape[1:]).astype(dtype)


def _layers(w: Any) -> tuple[Any, int, Any, Any]:
    """(the stack, its layer count, the layer, one layer as shapes) of a `LayerOf`; a weight as a stack of one."""
    if isinstance(w, LayerOf):
        return w.stack, w.stack.codes.shape[0], w.layer, _layer_of(w.stack)
    return w, 1, 0, w


def expert_view(spec: str, x: jax.Array, w: Any) -> tuple[Quantized, Any] | None:
    """`w` (a weight or a `LayerOf`) as the expert kernels read it for `einsum(spec, x, w)`: (a stack of experts
    [layers, K, N], the expert to use), or None where this module's kernels do not take it that way."""
    stack, layers, layer, one = _layers(w)
    if not _takes_kernel(spec, x, one, {}):
        return None
    experts = _expert_stack(stack, layers, one)
    return None if experts is None else (experts, layer)


def _layer_of(stack: Quantized) -> Quantized:
    """One layer of a stack [layers, ...] as shapes only (what the kernel's choice looks at)."""
    codes, scales = (jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in (stack.codes, stack.scales))
    return Quantized(codes, scales, stack.format, stack.blocks)


def _expert_stack(stack: Quantized, layers: int, one: Quantized) -> Quantized | None:
    """`stack` (one weight `one` [K, ...] for `layers` 1, or a stack of its layers [layers, K, ...]) as a stack of
    experts [layers, K, N] with (1, block_k, block_n) blocks, or None where one's blocks do not flatten so
    (fp8_matmul takes it). The grouped expert kernel reads such a stack with masks at the edges and decodes its
    scales in registers, where fp8_matmul needs its activations padded to the tiles and its scales spread over every
    column first: two more kernels a call; and it reads one layer of a stack in place, where slicing it out would
    copy it.

    The columns' blocks flatten to equal runs when, past the first trailing axis whose block spans more than one
    element, every axis is whole, and that axis's blocks divide it (or nothing lies outside it). A block that spans
    a whole axis is as good as any larger one: it is made the power of two >= 16 above it, which the kernel's tiles
    divide or are divided by; other blocks must be such powers of two themselves."""
    k, trailing = one.shape[0], one.shape[1:]
    spans = [min(b, n) for b, n in zip(_full_blocks(one)[1:], trailing)]
    first = next((i for i, b in enumerate(spans) if b > 1), len(spans) - 1)
    if any(b != n for b, n in zip(spans[first + 1 :], trailing[first + 1 :])):
        return None
    if trailing[first] % spans[first] and math.prod(trailing[:first]) > 1:
        return None
    columns = math.prod(trailing)
    block_n = spans[first] * math.prod(trailing[first + 1 :])
    block_k, block_columns = _kernel_block(min(_full_blocks(one)[0], k), k), _kernel_block(block_n, columns)
    if block_k is None or block_columns is None:
        return None
    codes = stack.codes.reshape(layers, k, columns)
    scales = stack.scales.reshape(layers, one.scales.shape[0], -1)
    return Quantized(codes, scales, stack.format, (1, block_k, block_columns))


def _kernel_block(block: int, size: int) -> int | None:
    """A scale block of `block` elements along an axis of `size` as the grouped kernel's tiles can take it."""
    if block >= size:
        return max(MIN_TILE, _pow2_at_least(size))
    return block if block >= MIN_TILE and not block & (block - 1) else None
