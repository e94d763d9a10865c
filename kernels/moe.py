"""Grouped expert matmul: rows sorted by expert, each group multiplied by its own expert's matrix.

The pure-JAX reference of jaxserve.kernels.table's `grouped_matmul`, the same on every backend. It reads only the
experts the rows use, and never decodes a whole expert stack (a quantized stack's codes are decoded a slice at a
time, at most `DECODE_PASS_BYTES` of decoded weight held at once). Two equivalent forms:
- few rows (at most one per expert, i.e. decode): gather each row's expert matrix, one matrix-vector product per
  row; with more decoded weight than one pass may hold, in passes over slices of the input axis;
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

from .quant import DECODE_PASS_BYTES, FP4, Quantized, dense, pass_rows, take

F32 = jnp.float32


def grouped_matmul(x: jax.Array, w: Any, group_sizes: jax.Array, expert_offset: jax.Array | int = 0) -> jax.Array:
    """x [m, d] (rows sorted by group), w [n, d, f] (an array or Quantized), group_sizes [e] (sum <= m) -> [m, f];
    float32 accumulation. Group g's rows are multiplied by expert `w[expert_offset + g]`: `w` may be a stack of
    several layers' experts (n = layers x e), read in place (slicing one layer out would copy all its experts).

    Rows past sum(group_sizes) belong to no group and come out zero.
    """
    group_sizes = group_sizes.astype(jnp.int32)
    m, e = x.shape[0], group_sizes.shape[0]
    if m <= e:
        return gathered_matmul(x, w, group_sizes, expert_offset)
    rows_per_expert = -(-m // e)
    tile = min(32, max(8, 1 << (rows_per_expert - 1).bit_length()))
    return tiled_matmul(x, w, group_sizes, tile, expert_offset)


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


def gathered_matmul(x: jax.Array, w: Any, group_sizes: jax.Array, expert_offset: jax.Array | int = 0) -> jax.Array:
    """grouped_matmul reading only the rows' own expert matrices: one [d, f] gather per row (a slice of the input
    axis per pass when the decoded rows would not fit one)."""
    m, d = x.shape
    e, f = group_sizes.shape[0], w.shape[2]
    group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")  # e for rows in no group
    experts = expert_offset + jnp.minimum(group, e - 1)
    size = _input_slice_rows(w, m * f * jnp.dtype(x.dtype).itemsize)

    def one_slice(start) -> jax.Array:
        rows_w = dense(_take_input_slice(w, experts, start, size), x.dtype)  # [m, size, f]
        x_slice = jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)
        return jnp.einsum("md,mdf->mf", x_slice, rows_w, preferred_element_type=F32)

    if size == d:
        out = jnp.einsum("md,mdf->mf", x, dense(take(w, experts), x.dtype), preferred_element_type=F32)
    else:
        # The first slice is the initial sum, so the loop's carry has the body's type (under shard_map, varying
        # over the same mesh axes: a zeros carry would not be).
        out = jax.lax.fori_loop(1, d // size, lambda i, acc: acc + one_slice(i * size), one_slice(0))
    return jnp.where((group < e)[:, None], out, 0.0)


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
