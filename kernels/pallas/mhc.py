"""Pallas mHC collapse: `jaxserve.kernels.mhc.hc_pre` in two kernels, and the final `hc_head` in the same two with
the pre part alone.

The reference is, on a GPU, five or six kernels a hyper-connection (the projection as a split-K matmul and its
reduction, the RMS sum, the Sinkhorn loop, the weighted sum of the streams), and two more for the block's input
norm, twice a layer. Here:

1. `mixes`: grid (row blocks, splits of d). Program (i, s) reads its rows' columns of d [bm, d / splits] of every
   stream in steps of bc columns, accumulates the three projections (pre, post, comb: each a [bc, P] slice of fn,
   columns past the part masked to 0) and the streams' Gram matrix G[a, b] = sum_d h_a h_b (n^2 sums), and stores
   the partial sums [bm, 4P] (pre | post | comb | G row-major). The reduction over x = n * d is spread over
   `splits` programs so that a decode step's few rows do not stream fn (n * d * m floats) through one
   multiprocessor.
2. `collapse`: grid (row blocks, chunks of d). Program (i, c) adds the splits' partial sums, normalises them (RMS
   over x: the square sum is G's trace), applies scale and base and the sigmoids, and writes x[rows, chunk] =
   sum_n pre_n h_n[rows, chunk]; the programs of chunk 0 also run the Sinkhorn loop in registers and write post
   and comb. Every chunk recomputes the few floats of pre: cheaper than a third kernel. With the block's norm
   weight, x comes out RMS-normalised: sum_d x^2 = pre^T G pre, known to every chunk without reading the others,
   so the norm costs no kernel of its own.

The operations are the reference's, in float32; sums associate differently (split sums, then the splits' total; the
norm's square sum from G, of x before its rounding to h's dtype), a few ulps. P = max(16, n^2) (Triton's dot
minimum), n a power of two with n^2 >= 16 so that the comb part reshapes to [bm, n, n] without slicing registers
(V4: n = 4). Rows and columns past the arrays' ends are masked, so nothing is padded or copied outside the kernels.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..quant import layer_stacks

F32 = jnp.float32
I32 = jnp.int32
DOT_MIN = 16  # Triton's smallest dot dimension
PARTS = 3  # pre, post, comb


def hc_pre(
    h: jax.Array, fn: Any, base: Any, scale: Any, norm: Any = None, *, norm_eps: float, hc_eps: float, iters: int,
    **options: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """h [..., n, d] -> (x [..., d] in h's dtype, post [..., n], comb [..., n, n]), as the reference (x normalised
    when `norm` is given); the weights plain or `LayerOf` views of the segment's stacks, read in place (slicing a
    layer out is a launch a weight). `options`: `_collapse`'s (interpret mode, tiles)."""
    x, post, comb = _collapse(
        h, fn, base, scale, norm, parts=PARTS, norm_eps=norm_eps, hc_eps=hc_eps, iters=iters, **options
    )
    *lead, n, _ = h.shape
    return x, post.reshape(*lead, n), comb.reshape(*lead, n, n)


def hc_head(
    h: jax.Array, fn: Any, base: Any, scale: Any, norm: Any = None, *, norm_eps: float, hc_eps: float, **options: Any
) -> jax.Array:
    """The final collapse, as the reference `jaxserve.kernels.mhc.hc_head`: the same two kernels with the pre part
    alone (fn [n * d, n], base [n], scale [1]), x normalised by the final norm when `norm` is given."""
    return _collapse(h, fn, base, scale, norm, parts=1, norm_eps=norm_eps, hc_eps=hc_eps, iters=0, **options)[0]


@functools.partial(
    jax.jit,
    static_argnames=("parts", "norm_eps", "hc_eps", "iters", "interpret", "block_rows", "block_cols", "split_cols"),
)
def _collapse(
    h: jax.Array,
    fn: Any,
    base: Any,
    scale: Any,
    norm: Any,
    *,
    parts: int,
    norm_eps: float,
    hc_eps: float,
    iters: int,
    interpret: bool = False,
    block_rows: int = 16,
    block_cols: int = 256,
    split_cols: int = 1024,
) -> tuple[jax.Array, ...]:
    """The two kernels over the first `parts` parts of the mixes (3: pre, post, comb; 1: pre): (x [..., d], and for
    3 parts post [rows, n] and comb [rows, n, n]). `split_cols` elements of the flattened streams per program of the
    first kernel (split_cols / n columns of d of each stream), `block_cols` columns a step (and the second kernel's
    chunk of d); all powers of two, block_rows and block_cols at least 16."""
    *lead, n, d = h.shape
    (fn, base, scale, *norms), layer = layer_stacks(fn, base, scale, *([] if norm is None else [norm]))
    width = max(DOT_MIN, n * n)
    if n & (n - 1) or n * n < DOT_MIN:
        raise ValueError(f"the Pallas mHC collapse takes a power-of-two stream count with n^2 >= 16; got n = {n}")
    for name, size in (("block_rows", block_rows), ("block_cols", block_cols), ("split_cols", split_cols)):
        if size < DOT_MIN or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= {DOT_MIN}; got {size}")
    mixes = sum(_part(n, part)[1] for part in range(parts))
    if fn.shape[1:] != (n * d, mixes):
        raise ValueError(f"fn must be [n * d, {mixes}] = {(n * d, mixes)}; got {fn.shape[1:]}")
    flat = h.reshape(-1, n * d)
    rows = flat.shape[0]
    bm, bc = block_rows, min(block_cols, pl.next_power_of_2(d))
    steps = max(1, split_cols // (n * bc))
    splits = pl.cdiv(d, steps * bc)
    row_blocks = pl.cdiv(rows, bm)
    params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    sums = pl.pallas_call(
        functools.partial(_mixes_kernel, rows=rows, n=n, d=d, bm=bm, bc=bc, steps=steps, width=width, parts=parts),
        out_shape=jax.ShapeDtypeStruct((splits, rows, (parts + 1) * width), F32),
        grid=(row_blocks, splits),
        interpret=interpret,
        compiler_params=params,
        name="hc_mixes",
    )(layer, flat, fn)
    out_shape = [jax.ShapeDtypeStruct((rows, d), h.dtype)]
    if parts == PARTS:
        out_shape += [jax.ShapeDtypeStruct((rows, n), F32), jax.ShapeDtypeStruct((rows, n, n), F32)]
    x, *mixing = pl.pallas_call(
        functools.partial(
            _collapse_kernel,
            rows=rows,
            n=n,
            d=d,
            bm=bm,
            bd=bc,
            splits=splits,
            width=width,
            parts=parts,
            norm_eps=norm_eps,
            hc_eps=hc_eps,
            iters=iters,
            normed=bool(norms),
        ),
        out_shape=tuple(out_shape),
        grid=(row_blocks, pl.cdiv(d, bc)),
        interpret=interpret,
        compiler_params=params,
        name="hc_collapse",
    )(layer, sums, flat, base, scale, *norms)
    return (x.reshape(*lead, d), *mixing)


def _iota(shape: tuple[int, ...], axis: int) -> jax.Array:
    return lax.broadcasted_iota(I32, shape, axis)


def _part(n: int, part: int) -> tuple[int, int]:
    """(first column, width) of part `part` (pre, post, comb) of the mixes."""
    return (0, n) if part == 0 else (n, n) if part == 1 else (2 * n, n * n)


def _mixes_kernel(
    layer_ref, h_ref, fn_ref, out_ref, *, rows: int, n: int, d: int, bm: int, bc: int, steps: int, width: int,
    parts: int,
):  # fmt: skip
    """Program (row block, split): the split's partial projections and Gram matrix of its rows."""
    block, split = pl.program_id(0), pl.program_id(1)
    row0 = block * bm
    row = row0 + _iota((bm, 1), 0)
    layer = layer_ref[0]
    col = _iota((1, width), 1)

    def step(i, carry):
        gram, *acc = carry
        c0 = (split * steps + i) * bc
        h_mask = (row < rows) & (c0 + _iota((1, bc), 1) < d)
        fn_rows = c0 + _iota((bc, 1), 0) < d
        hs = [
            plgpu.load(h_ref.at[pl.ds(row0, bm), pl.ds(stream * d + c0, bc)], mask=h_mask, other=0).astype(F32)
            for stream in range(n)
        ]
        for stream, hx in enumerate(hs):
            for part in range(parts):
                first, size = _part(n, part)
                part_slice = fn_ref.at[layer, pl.ds(stream * d + c0, bc), pl.ds(first, width)]
                w = plgpu.load(part_slice, mask=fn_rows & (col < size), other=0).astype(F32)
                acc[part] += jnp.dot(hx, w, preferred_element_type=F32, precision=lax.Precision.HIGHEST)
        for a in range(n):
            for b in range(a, n):
                pair = jnp.sum(hs[a] * hs[b], axis=1, keepdims=True)
                gram += jnp.where((col == a * n + b) | (col == b * n + a), pair, 0.0)
        return (gram, *acc)

    zeros = jnp.zeros((bm, width), F32)
    gram, *acc = lax.fori_loop(0, steps, step, (zeros,) * (parts + 1))
    for part, sums in enumerate([*acc, gram]):
        plgpu.store(out_ref.at[split, pl.ds(row0, bm), pl.ds(part * width, width)], sums, mask=row < rows)


def _collapse_kernel(
    layer_ref, sums_ref, h_ref, base_ref, scale_ref, *refs,
    rows: int, n: int, d: int, bm: int, bd: int, splits: int, width: int, parts: int,
    norm_eps: float, hc_eps: float, iters: int, normed: bool,
):  # fmt: skip
    """Program (row block, chunk of d): the mixes, x over the chunk (normalised if `normed`: refs start with the
    norm weight); with all three parts, chunk 0 also post and comb (the refs after x)."""
    norm_refs, (x_ref, *mixing_refs) = refs[: int(normed)], refs[int(normed) :]
    block, chunk = pl.program_id(0), pl.program_id(1)
    row0, c0 = block * bm, chunk * bd
    layer = layer_ref[0]
    row = row0 + _iota((bm, 1), 0)
    col = _iota((1, width), 1)

    def add_split(s, acc):
        return tuple(
            a + plgpu.load(sums_ref.at[s, pl.ds(row0, bm), pl.ds(part * width, width)], mask=row < rows, other=0)
            for part, a in enumerate(acc)
        )

    zeros = jnp.zeros((bm, width), F32)
    *acc, gram = lax.fori_loop(0, splits, add_split, (zeros,) * (parts + 1))
    in_gram = col < n * n
    squares = jnp.sum(jnp.where(in_gram & (col // n == col % n), gram, 0.0), axis=1, keepdims=True)
    inv_rms = lax.rsqrt(squares / (n * d) + norm_eps)

    def logits(part: int) -> jax.Array:
        first, size = _part(n, part)
        base = plgpu.load(base_ref.at[layer, pl.ds(first, width)], mask=col[0] < size, other=0).astype(F32)
        return acc[part] * inv_rms * scale_ref[layer, part].astype(F32) + base[None, :]

    pre = jax.nn.sigmoid(logits(0)) + hc_eps
    weights = [jnp.sum(jnp.where(col == stream, pre, 0.0), axis=1, keepdims=True) for stream in range(n)]
    x = jnp.zeros((bm, bd), F32)
    in_chunk = (row < rows) & (c0 + _iota((1, bd), 1) < d)
    for stream, weight in enumerate(weights):
        h = plgpu.load(h_ref.at[pl.ds(row0, bm), pl.ds(stream * d + c0, bd)], mask=in_chunk, other=0)
        x += weight * h.astype(F32)
    if normed:  # sum_d x^2 = sum_ab pre_a pre_b G[a, b]; x rounded to h's dtype first, as the reference norms it
        pre_a = sum(jnp.where(col // n == stream, weight, 0.0) for stream, weight in enumerate(weights))
        pre_b = sum(jnp.where(col % n == stream, weight, 0.0) for stream, weight in enumerate(weights))
        x_squares = jnp.sum(jnp.where(in_gram, pre_a * pre_b * gram, 0.0), axis=1, keepdims=True)
        norm = plgpu.load(norm_refs[0].at[layer, pl.ds(c0, bd)], mask=c0 + _iota((bd,), 0) < d, other=0)
        x = x.astype(x_ref.dtype).astype(F32) * lax.rsqrt(x_squares / d + norm_eps) * norm.astype(F32)[None, :]
    plgpu.store(x_ref.at[pl.ds(row0, bm), pl.ds(c0, bd)], x.astype(x_ref.dtype), mask=in_chunk)

    if parts < PARTS:
        return
    post_ref, comb_ref = mixing_refs

    @pl.when(chunk == 0)
    def _():
        post = 2.0 * jax.nn.sigmoid(logits(1))
        plgpu.store(post_ref.at[pl.ds(row0, bm), pl.ds(0, width)], post, mask=(row < rows) & (col < n))
        comb = _sinkhorn(logits(2).reshape(bm, n, n), iters, hc_eps)
        plgpu.store(comb_ref.at[pl.ds(row0, bm)], comb, mask=(row < rows)[:, :, None])


def _sinkhorn(m: jax.Array, iters: int, eps: float) -> jax.Array:
    """The reference's Sinkhorn on [bm, n, n] in registers: row softmax (+ eps), a column pass, then iters - 1
    (row, column) passes."""
    m = jnp.exp(m - jnp.max(m, axis=-1, keepdims=True))
    m = m / jnp.sum(m, axis=-1, keepdims=True) + eps
    m = m / (jnp.sum(m, axis=-2, keepdims=True) + eps)

    def row_then_column(_, m):
        m = m / (jnp.sum(m, axis=-1, keepdims=True) + eps)
        return m / (jnp.sum(m, axis=-2, keepdims=True) + eps)

    return lax.fori_loop(0, iters - 1, row_then_column, m)


def mixes_hbm_bytes(operand_shapes: list[tuple[int, ...]], operand_bytes: list[float], out_bytes: float) -> float:
    """The HBM bytes one `hc_mixes` call moves, from its operands as compiled (the layer index, h [rows, n * d], fn
    [layers, n * d, m]): h once, one layer of fn, the partial sums written."""
    layer, h, fn = operand_bytes
    return layer + h + fn / operand_shapes[2][0] + out_bytes


def collapse_hbm_bytes(operand_shapes: list[tuple[int, ...]], operand_bytes: list[float], out_bytes: float) -> float:
    """The HBM bytes one `hc_collapse` call moves, from its operands as compiled (the layer index, the partial sums,
    h, base [layers, m], scale [layers, 3], any norm weight [layers, d]): the sums and h once (each chunk's programs
    read their part of every stream), one layer of the weights, x, post and comb written."""
    layer, sums, h, *weights = operand_bytes
    layers = operand_shapes[3][0]
    return layer + sums + h + sum(weights) / layers + out_bytes
