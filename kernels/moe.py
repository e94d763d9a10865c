"""Grouped expert matmul: rows sorted by expert, each group multiplied by its own expert's matrix.

The pure-JAX reference of jaxserve.kernels.table's `grouped_matmul`. It reads only the experts the rows use, and
never decodes a whole expert stack (a quantized stack's codes are decoded a slice at a time, at most
`DECODE_PASS_BYTES` of decoded weight held at once). Two equivalent forms:
- few rows (at most one per expert, i.e. decode): gather each row's expert matrix, one matrix-vector product per
  row. With `fused_decode` (the table sets it on GPUs) the product is written as a sum of elementwise products
  with the codes decoded inside it, not as a dot: XLA fuses the gather, the decode and the products into the
  reduction's one kernel, which reads each row's expert codes once and writes no decoded copy, in one pass; it
  then also takes up to FUSED_GATHER_ROWS_PER_EXPERT rows an expert.
  Otherwise (XLA on CPU, where a dot on decoded matrices is faster) in passes over slices of the input axis when
  the decoded weight would not fit one;
- more rows: cut the sorted rows into tiles; a tile meets few groups (in all at most tiles + experts
  (tile, expert) pairs), so multiply each pair once and add the partial tiles back; with more decoded weight than
  one pass may hold, in passes over a few pairs at a time.
`jax.lax.ragged_dot` is the oracle in tests: XLA lowers it densely (every row times every expert, on CPU after
re-laying out the whole stack on each call; on GPU over a group-broadcast operand). Against it on the `small`
preset (2 CPU cores, whole runner steps): decode at batch 1 3.0x faster, batch 8 1.6x, a 256-token prefill chunk
2.0x. The Pallas kernel (jaxserve.kernels.pallas.grouped_matmul) decodes the codes in registers instead.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .quant import (
    DECODE_PASS_BYTES,
    FP4,
    Quantized,
    dense,
    expand_scales,
    fp4_values,
    pass_rows,
    scale_values,
    take,
)
from .quant import einsum as quant_einsum

F32 = jnp.float32
# With fused_decode the gathered form reads one expert matrix a row and the tiled form writes a decoded matrix per
# (tile, expert) item and reads it back (about 8x the FP4 codes' bytes an item): the gathered form moves fewer bytes
# up to a few rows an expert (Flash's 4 layers decoding 64 rows, 1.5 rows an expert, on a deviceless H200: 217.7 ->
# 17.5 ms in XLA's cost model).
FUSED_GATHER_ROWS_PER_EXPERT = 4
# The most routed rows (tokens x top-k) a step sends through `expert_rows` instead of sorting them into groups: the
# Pallas kernel multiplies every row of the step by each touched expert (masked), so its dots grow with the rows.
EXPERT_ROWS_MAX = 64


def grouped_matmul(
    x: jax.Array,
    w: Any,
    group_sizes: jax.Array,
    expert_offset: jax.Array | int = 0,
    fused_decode: bool = False,
    *,
    out_dtype: Any = F32,
    every_row_grouped: bool = False,
) -> jax.Array:
    """x [m, d] (rows sorted by group), w [n, d, f] (an array or Quantized), group_sizes [e] (sum <= m) -> [m, f]
    in `out_dtype`; float32 accumulation. Group g's rows are multiplied by expert `w[expert_offset + g]`: `w` may be
    a stack of several layers' experts (n = layers x e), read in place (slicing one layer out would copy all its
    experts). `fused_decode`: the backend fuses a gather and a decode into the reduction that consumes them (XLA on a
    GPU). `every_row_grouped`: the caller's promise that the groups hold all m rows (the kernels may then skip
    zeroing the others; nothing to skip here).

    Rows past sum(group_sizes) belong to no group and come out zero.
    """
    del every_row_grouped  # the forms below zero the rows in no group whatever the promise: no work saved here
    group_sizes = group_sizes.astype(jnp.int32)
    m, e = x.shape[0], group_sizes.shape[0]
    if m <= e or (fused_decode and m <= FUSED_GATHER_ROWS_PER_EXPERT * e):
        out = gathered_matmul(x, w, group_sizes, expert_offset, fused_decode)
    else:
        rows_per_expert = -(-m // e)
        tile = min(32, max(8, 1 << (rows_per_expert - 1).bit_length()))
        out = tiled_matmul(x, w, group_sizes, tile, expert_offset)
    return out.astype(out_dtype)


def _input_slice_rows(w: Any, bytes_per_row: int) -> int:
    """Rows of the input axis (-2) one pass decodes: whole scale blocks and whole packed FP4 pairs."""
    unit = 1
    if isinstance(w, Quantized):
        unit = max(2 if w.format == FP4 else 1, w.blocks[-2])
    return pass_rows(w.shape[-2], unit, bytes_per_row)


def _take_input_slice(w: Any, experts: jax.Array, start: jax.Array, size: int) -> Any:
    """`w[experts, start:start + size]` (rows of each expert's input axis), codes and scales alike, in one gather
    per leaf; `start` and `size` are whole blocks (and whole packed pairs)."""
    if not isinstance(w, Quantized):
        return w[experts[:, None], start + jnp.arange(size)[None, :]]
    per_code = 2 if w.format == FP4 else 1
    block = w.blocks[-2]
    codes = w.codes[experts[:, None], start // per_code + jnp.arange(size // per_code)[None, :]]
    scales = w.scales[experts[:, None], start // block + jnp.arange(-(-size // block))[None, :]]
    return Quantized(codes, scales, w.format, w.blocks)


def _row_products(x: jax.Array, w: Any, fused_decode: bool) -> jax.Array:
    """x [m, d], w [m, d, f] (one matrix a row, an array or Quantized) -> sum_d x[m, d] * w[m, d, f], [m, f] float32.
    Where the backend fuses producers into a reduction, the codes are decoded inside the sum, as elementwise work
    on its operand (each FP4 byte's two values times their pair of x, then the block's scale), and never written
    decoded; elsewhere a dot on the decoded matrices is faster (XLA on CPU: 1.5x at the `small` preset's sizes)."""
    if not fused_decode:
        return jnp.einsum("md,mdf->mf", x, dense(w, x.dtype), preferred_element_type=F32)
    m, d = x.shape
    xf = x.astype(F32)
    if not isinstance(w, Quantized):
        return jnp.sum(xf[:, :, None] * w.astype(F32), axis=1)
    blocks: tuple[int, ...]
    if w.format == FP4:  # codes [m, d / 2, f]: byte k holds elements 2k (low nibble) and 2k + 1 (high)
        pairs = xf.reshape(m, d // 2, 2)
        values = pairs[..., 0, None] * fp4_values(w.codes & 0xF) + pairs[..., 1, None] * fp4_values(w.codes >> 4)
        blocks = (w.blocks[-2] // 2, w.blocks[-1])  # a scale block along the input axis is half as many bytes
    else:
        values, blocks = xf[:, :, None] * w.codes.astype(F32), w.blocks[-2:]
    scales = expand_scales(scale_values(w.scales), blocks, values.shape)
    return jnp.sum(values * scales, axis=1)


def gathered_matmul(
    x: jax.Array, w: Any, group_sizes: jax.Array, expert_offset: jax.Array | int = 0, fused_decode: bool = False
) -> jax.Array:
    """grouped_matmul reading only the rows' own expert matrices (`row_matmul`)."""
    m = x.shape[0]
    e = group_sizes.shape[0]
    group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right", method="compare_all")  # e: no group
    out = row_matmul(x, w, expert_offset + jnp.minimum(group, e - 1), fused_decode)
    return jnp.where((group < e)[:, None], out, 0.0)


def row_matmul(x: jax.Array, w: Any, experts: jax.Array, fused_decode: bool = False) -> jax.Array:
    """x [m, d], w [n, d, f], experts [m] (indices into w) -> [m, f] float32: each row times its own expert's matrix,
    one [d, f] gather per row, summed against the row (`_row_products`); where the backend decodes into memory, in
    passes over slices of the input axis."""
    m, d = x.shape
    f = w.shape[2]
    size = d if fused_decode else _input_slice_rows(w, m * f * jnp.dtype(x.dtype).itemsize)

    def one_slice(start) -> jax.Array:
        x_slice = jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)
        return _row_products(x_slice, _take_input_slice(w, experts, start, size), fused_decode)

    if size == d:
        return _row_products(x, take(w, experts), fused_decode)
    # The first slice is the initial sum, so the loop's carry has the body's type (under shard_map, varying over the
    # same mesh axes: a zeros carry would not be).
    return jax.lax.fori_loop(1, d // size, lambda i, acc: acc + one_slice(i * size), one_slice(0))


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def gated_matmul(x: jax.Array, w_gate: Any, w_up: Any, swiglu_limit: float) -> jax.Array:
    """The shared expert's first half: x [n, d] times two projections [d, f] (plain, Quantized or `LayerOf`), each
    product in x's dtype, then clamped_swiglu(gate, up) -> [n, f] in x's dtype."""
    gate = quant_einsum("nd,df->nf", x, w_gate)
    up = quant_einsum("nd,df->nf", x, w_up)
    return clamped_swiglu(gate, up, swiglu_limit)


def expert_rows(
    x: jax.Array,
    stacks: tuple[Any, ...],
    experts: jax.Array,
    fused_decode: bool = False,
    *,
    swiglu_limit: float | None = None,
    out_dtype: Any = F32,
    repeats: int = 1,
) -> jax.Array:
    """Routed rows in any order, each times its own expert: x [a / repeats, d] (assignment i's row is x[i // repeats]:
    a token's top-k assignments share its row, never copied `repeats` times by a kernel), `stacks` one expert
    stack [n, d, f] (an array or Quantized), or two (gate, up) with `swiglu_limit`, experts [a] int32 indices into the
    stacks -> [a, f] in `out_dtype`, float32 accumulation: x W[experts], or clamped_swiglu(x W_gate, x W_up, limit).
    A row whose index is outside [0, n) belongs to no expert; its result is unspecified (zero here; a kernel may
    leave it unwritten), so callers mask it. No sort, no groups: the decode-sized form (`EXPERT_ROWS_MAX` rows)."""
    if (len(stacks) == 2) != (swiglu_limit is not None):
        raise ValueError("expert_rows takes one stack, or two (gate, up) with a swiglu_limit")
    x = jnp.repeat(x, repeats, axis=0)
    valid = (experts >= 0) & (experts < stacks[0].shape[0])
    safe = jnp.where(valid, experts, 0)
    outs = [row_matmul(x, w, safe, fused_decode) for w in stacks]
    out = outs[0] if swiglu_limit is None else clamped_swiglu(outs[0], outs[1], swiglu_limit)
    return jnp.where(valid[:, None], out, 0.0).astype(out_dtype)


def tiled_matmul(
    x: jax.Array, w: Any, group_sizes: jax.Array, tile: int, expert_offset: jax.Array | int = 0
) -> jax.Array:
    """grouped_matmul over (tile, group) work items: item i multiplies tile `tile_of[i]` by expert `group[i]`; in
    passes of as many items as DECODE_PASS_BYTES of decoded experts allow."""
    m, d = x.shape
    e, f = group_sizes.shape[0], w.shape[2]
    n_tiles = -(-m // tile)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    tiles_of_group = jnp.where(group_sizes > 0, (ends - 1) // tile - starts // tile + 1, 0)
    items_end = jnp.cumsum(tiles_of_group)
    n_items = n_tiles + e  # a static bound on the number of (tile, group) pairs
    per_pass = min(n_items, max(1, DECODE_PASS_BYTES // (d * f * jnp.dtype(x.dtype).itemsize)))
    passes = -(-n_items // per_pass)
    item = jnp.arange(passes * per_pass)
    used = item < items_end[-1]
    # compare_all: one fused kernel on a GPU (the default binary search is a loop of a few kernels a step).
    group = jnp.minimum(jnp.searchsorted(items_end, item, side="right", method="compare_all"), e - 1)
    tile_of = jnp.where(used, starts[group] // tile + item - (items_end[group] - tiles_of_group[group]), 0)
    tiles = jnp.pad(x, ((0, n_tiles * tile - m), (0, 0))).reshape(n_tiles, tile, d)

    def one_pass(items: jax.Array) -> jax.Array:
        """The items' partial tiles summed into [n_tiles, tile, f]."""
        g, t = group[items], tile_of[items]
        experts = dense(take(w, expert_offset + g), x.dtype)
        partial = jnp.einsum("itd,idf->itf", tiles[t], experts, preferred_element_type=F32)
        row = t[:, None] * tile + jnp.arange(tile)[None, :]
        mine = used[items][:, None] & (row >= starts[g][:, None]) & (row < ends[g][:, None])
        return jax.ops.segment_sum(jnp.where(mine[..., None], partial, 0.0), t, num_segments=n_tiles)

    if passes == 1:
        out = one_pass(item)
    else:
        # The first pass is the initial sum, so the carry has the body's type (as in gathered_matmul).
        out = jax.lax.fori_loop(
            1,
            passes,
            lambda i, acc: acc + one_pass(i * per_pass + jnp.arange(per_pass)),
            one_pass(jnp.arange(per_pass)),
        )
    return out.reshape(n_tiles * tile, f)[:m]
