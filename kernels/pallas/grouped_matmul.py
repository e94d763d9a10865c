"""Pallas grouped expert matmul: `jaxserve.kernels.moe.grouped_matmul` reading plain, FP8 or FP4 expert stacks.

Letters: m rows of x, d input features, f output features, e groups, n >= o + e experts in the stack, o the
expert offset; bm, bk, bf the row, input and output tiles; t a row tile, g a group, whose expert is o + g (the
model passes several layers' experts as one stack, read in place, and o = layer * e). Rows are sorted by group:
group g owns rows [start_g, end_g), with end_g - start_g = group_sizes[g] and rows past end_{e-1} in no group. The
result is, in float32,

    out[r, :] = sum_k x[r, k] * W[o + g(r), k, :]   for r in group g(r);   out[r, :] = 0 for rows in no group,

where W is the expert stack as given (plain arrays) or decoded from its codes: each element is its code's value
times its block's scale 2^(u - 127), u the block's ue8m0 byte (u = 0 gives 2^-127, a float32 denormal; u = 255
gives NaN). FP8 codes are e4m3fn [n, d, f], one byte each, with one scale per block of `w.blocks` (the release:
128 x 128); FP4 codes are bytes [n, d/2, f] holding two e2m1 nibbles packed along the input axis (low nibble =
element 2k, high = 2k+1) with one scale per 32 inputs of one output column. As in the reference, decoded weights
are rounded to x's dtype (exact: a code times a power of two fits bfloat16) and each dot accumulates in float32.

Work items. Plain JAX outside the kernel cuts the sorted rows into tiles of bm and lists the (row tile, group)
pairs that meet, group by group: at most n_tiles + e - 1 of them, so the grid has the static bound n_tiles + e
and the programs past the real count return at once (`pl.when`). Empty groups get no item, so only the experts
the step touches are read. The grid is (items, f / bf); program (i, j) loads item i's row tile, expert and group
bounds from the metadata arrays, loops over k in steps of bk (`fori_loop`) and keeps a [bm, bf] float32
accumulator. Each step loads the x tile [bm, bk], the expert's code tile and the scales covering it, decodes them
with integer and float ops in registers (FP8 codes are bitcast to uint8 once loaded; no dtype cast from a float8
or float4 type: Hopper has no FP4 convert) and adds one dot (FP4: two, see below). The program then stores only
the rows of its tile that lie in its group; items of one tile write disjoint rows, so the programs never race,
and the output starts as zeros (an aliased input) so rows in no group stay zero (unless the caller says every row
is in a group: then every row is written and no zeros are made). The sums are rounded once to the output's dtype.

FP4 packing: the nibbles of one byte are inputs 2k and 2k+1, so instead of interleaving decoded rows the kernel splits x
into its even and odd columns (one [2, m, d/2] array, made outside the kernel by one XLA fusion: activations are small
next to the expert stack; other formats pass x as [1, m, d]) and adds x_even @ low nibbles + x_odd @ high nibbles, both
[bm, bk/2] @ [bk/2, bf].

Bytes read per item (row tile t, group g): the x rows of t ([bm, d], once per f tile) and expert o + g's codes and
scales once in all (each f tile reads its [d, bf] slice): d f bytes of FP8 codes plus d f / 128^2 scale bytes,
d f / 2 bytes of FP4 codes plus d f / 32 scale bytes. An expert is read once per row tile its group spans. No
decoded stack is ever written; the stacks are not copied or padded: partial tiles at the ends of m, d and f are
loaded with masks (codes and x as 0, scales as 1) and partial output tiles are stored with masks. (A masked code
still meets its block's scale: 0 times a NaN scale is NaN, in a column the block's real weights already make NaN.)

Choices for the generic `pl.pallas_call` API, which on NVIDIA GPUs lowers through Triton (no scalar prefetch
there): every operand is a whole-array ref (default BlockSpecs, no data-dependent index maps), the metadata are
ordinary int32 inputs read as scalars, and tiles are cut with `pl.ds` from those values through `plgpu.load` /
`plgpu.store` masks. Block sizes are powers of two and at least 16 (Triton's dot minimum; FP4's dots have K =
bk/2, so bk >= 32 there). A tile's scales are loaded as the small [bk / block, bf / block] grid of blocks it spans,
decoded, and broadcast to the tile by a broadcast + reshape.

Checked on CPU: results with interpret=True, and that lowering for CUDA passes Pallas' Triton lowering rules (the
kernel becomes a Triton call; that check found the FP8 code load's `other` needing the codes' float8 type).
Unverified without a GPU: Triton's own compilation (scalar loads of the metadata, masked 3-D loads at a dynamic
expert index, the uint8 / float8 loads and bitcasts, the broadcast + reshape of the scales, the aliased zero
output), any GPU run and its speed; whether Triton keeps float32 denormals (a scale byte of 0, 2^-127, is one;
flush-to-zero would turn such weights into 0 where a GPU reference may keep them; XLA:CPU itself treats denormals
as 0, so on CPU that case only shows kernel and reference agreeing on 0); that out-of-range reads are really
masked (interpret mode pads instead of faulting). Float32 x and weights make IEEE float32 dots (no TF32), slow on
tensor cores. The default tiles and num_warps / num_stages are guesses, not measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..quant import FP4, FP8, SCALE_BIAS, Quantized

F32 = jnp.float32
I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The static shape of the work, in the units the kernel indexes.

    The code ref has `kc` rows (plain, FP8: kc = d; FP4: kc = d / 2 bytes, and x [m, d] is read as `halves` = 2 tiles
    a step, its even and odd columns); `bkc` is the k step in those units. Scales: `scale_shape` is the
    per-expert [rows, cols] of the scale ref, `scale_block` how many code rows / columns one scale covers."""

    fmt: str | None  # None for a plain array, else FP8 / FP4
    m: int
    kc: int
    f: int
    bm: int
    bkc: int
    bf: int
    compute_dtype: Any
    scale_shape: tuple[int, int] = (0, 0)
    scale_block: tuple[int, int] = (1, 1)
    halves: int = 1

    @property
    def k_steps(self) -> int:
        return pl.cdiv(self.kc, self.bkc)

    @property
    def scale_tile(self) -> tuple[int, int]:
        """Scale rows / columns one [bkc, bf] weight tile spans (tile and block sizes divide one another)."""
        return max(1, self.bkc // self.scale_block[0]), max(1, self.bf // self.scale_block[1])


@functools.partial(
    jax.jit,
    static_argnames=(
        "interpret", "block_m", "block_k", "block_f", "num_warps", "num_stages", "out_dtype", "every_row_grouped",
        "norm_eps",
    ),
)  # fmt: skip
def grouped_matmul(
    x: jax.Array,
    w: jax.Array | Quantized,
    group_sizes: jax.Array,
    expert_offset: jax.Array | int = 0,
    *,
    interpret: bool = False,
    block_m: int | None = None,
    block_k: int = 128,
    block_f: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
    out_dtype: Any = F32,
    every_row_grouped: bool = False,
    x_norm: tuple[jax.Array, jax.Array] | None = None,
    norm_eps: float = 0.0,
) -> jax.Array:
    """x [m, d] (rows sorted by group), w [n, d, f] (an array or an FP8 / FP4 Quantized stack), group_sizes [e]
    (sum <= m) -> [m, f] in `out_dtype` (the float32 sums, rounded once); group g's rows times expert
    w[expert_offset + g]; rows past sum(group_sizes) are zero. `every_row_grouped`: the caller's promise that the
    groups hold all m rows (a projection as a stack of one expert), so the output needs no zeros first: one kernel
    fewer a call. `x_norm` (a stack of norm weights [layers, d] and the layer to use [1] int32): x's rows are
    RMS-normalised by it as they are loaded, `rms_norm(x, norm, norm_eps)` in float32 rounded to x's dtype as the
    reference does (a first pass over the row sums its squares): the projection's input norm costs no kernel.

    block_m defaults to the rows per group rounded up to a power of two, within [16, 128]; block_k counts inputs
    of x (FP4: two per code byte)."""
    m, e, f = x.shape[0], group_sizes.shape[0], w.shape[-1]
    bm = block_m or min(128, max(16, pl.next_power_of_2(pl.cdiv(m, e))))
    layout, w_operands = _operands(x, w, bm, block_k, block_f)
    n_tiles = pl.cdiv(m, bm)
    metadata = _work_items(group_sizes.astype(I32), expert_offset, bm, n_tiles)
    # Under shard_map (expert parallelism) the result varies over the mesh axes the expert stack does.
    varying = jax.typeof(w_operands[0]).manual_axis_type
    inputs = (*metadata, x, *w_operands)
    aliases = {}
    if not every_row_grouped:  # rows in no group keep these zeros
        inputs, aliases = (*inputs, jnp.zeros((m, f), out_dtype)), {len(inputs): 0}
    if x_norm is not None:
        norms, norm_row = x_norm
        if norms.ndim != 2 or norms.shape[1] != x.shape[1] or norm_row.shape != (1,):
            raise ValueError(f"x_norm must be ([layers, {x.shape[1]}], [1]); got {norms.shape}, {norm_row.shape}")
        inputs = (*inputs, norms, norm_row.astype(I32))
    kernel = functools.partial(_kernel, layout=layout, n_w=len(w_operands), normed=x_norm is not None, eps=norm_eps)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, f), out_dtype, manual_axis_type=varying),
        grid=(n_tiles + e, pl.cdiv(f, layout.bf)),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="grouped_matmul",
    )(*inputs)


def hbm_bytes(operand_shapes: list[tuple[int, ...]], operand_bytes: list[float], out_bytes: float) -> float:
    """The most HBM bytes one call moves, from its operands as compiled, in order: 5 metadata arrays, x [*batch, m, d]
    (batch: axes a vmap of the call added, as the model's per-group output projection has), the weights (a plain
    stack, or codes and scales: [*batch, n, ...]), any zeros aliased to the output, any input norm (its stack
    [layers, d] and row [1]: the only operand of one dimension). Each work item reads its expert's codes and scales
    once (each f tile its own slice), and there are at most min(items - 1, rows) items that meet a row, in each
    batch's own stack; x, one norm row, and the output are read or written once. The expert stack itself, n experts
    of every layer, is never read whole: only the experts the rows use (this is what "only the experts the step
    touches are read" means above, bounded for any routing)."""
    norm = 0.0
    if len(operand_shapes[-1]) == 1:
        norm = operand_bytes[-2] / operand_shapes[-2][0] + operand_bytes[-1]
        operand_shapes, operand_bytes = operand_shapes[:-2], operand_bytes[:-2]
    x_dims = operand_shapes[5]
    zeros = len(operand_shapes) > 7 and operand_bytes[-1] == out_bytes and len(operand_shapes[-1]) == len(x_dims)
    weights = range(6, len(operand_shapes) - zeros)
    batch = math.prod(x_dims[:-2])
    experts = math.prod(operand_shapes[6][:-2])  # every batch's stack
    per_expert = sum(operand_bytes[i] for i in weights) / experts
    reads = batch * experts_read_at_most(operand_shapes[1][0], x_dims[-2], experts // batch)
    return reads * per_expert + operand_bytes[5] + out_bytes + sum(operand_bytes[:5]) + norm


def experts_read_at_most(items: int, rows: int, stack: int) -> int:
    """Expert loads of one call with `items` work-item slots (n_tiles + e) over `rows` sorted rows and a stack of
    `stack` experts, for any group sizes: one per used work item, at most n_tiles + e - 1 of them (consecutive groups
    share at most their boundary tile), and a used item holds at least one row."""
    return min(items - 1, rows, stack)


def _operands(x: jax.Array, w: Any, bm: int, bk: int, bf: int) -> tuple[_Layout, tuple]:
    """Checks the tiles against the format; returns the layout and the weight operand(s)."""
    m, d = x.shape
    f = w.shape[-1]
    fp4 = isinstance(w, Quantized) and w.format == FP4
    for name, size, least in (("block_m", bm, 16), ("block_k", bk, 32 if fp4 else 16), ("block_f", bf, 16)):
        if size < least or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= {least} (Triton's dot minimum); got {size}")
    if not isinstance(w, Quantized):
        dtype = jnp.promote_types(x.dtype, w.dtype)
        return _Layout(None, m, d, f, bm, bk, bf, dtype), (w,)
    if w.format == FP8:
        scale_block = (w.blocks[-2], w.blocks[-1])
        layout = _Layout(FP8, m, d, f, bm, bk, bf, x.dtype, w.scales.shape[-2:], scale_block)
    elif w.format == FP4:
        if w.blocks[-2] % 2:
            raise ValueError(f"FP4 scale blocks must cover whole code bytes (an even input count); got {w.blocks}")
        scale_block = (w.blocks[-2] // 2, w.blocks[-1])
        layout = _Layout(FP4, m, d // 2, f, bm, bk // 2, bf, x.dtype, w.scales.shape[-2:], scale_block, halves=2)
    else:
        raise ValueError(f"unknown weight format {w.format!r}")
    for tile, block in zip((layout.bkc, bf), scale_block):
        if tile % block and block % tile:
            raise ValueError(f"tiles (block_k={bk}, block_f={bf}) and scale blocks {w.blocks} must divide one another")
    return layout, (w.codes, w.scales)


def x_tiles(x_ref, rows: jax.Array, k0: Any, mask: jax.Array, lo: _Layout) -> list[jax.Array]:
    """x's [bm, bkc] tiles of the rows `rows` [bm, 1] at k step k0: one, or for FP4 two, inputs 2k and 2k + 1 (the
    low and high nibbles' rows), read in place at every other column (a split copy of x was one more launch a call).
    Indexed by arrays, not slices: Pallas's interpret mode loads no strided slice, nor slices beside arrays."""
    steps = k0 + lax.broadcasted_iota(I32, (1, lo.bkc), 1)
    return [plgpu.load(x_ref.at[rows, lo.halves * steps + half], mask=mask, other=0) for half in range(lo.halves)]


def _work_items(group_sizes: jax.Array, expert_offset: jax.Array | int, bm: int, n_tiles: int) -> tuple[jax.Array, ...]:
    """The (row tile, group) pairs that meet, group by group, padded to the static bound n_tiles + e.

    Returns count [1] and, per item, its row tile, its group's expert (expert_offset + group) and the group's rows
    [start, end); items past count are zeros."""
    e = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    tiles_of_group = jnp.where(group_sizes > 0, (ends - 1) // bm - starts // bm + 1, 0)
    items_end = jnp.cumsum(tiles_of_group)  # items of group g: [items_end[g] - tiles_of_group[g], items_end[g])
    item = jnp.arange(n_tiles + e, dtype=I32)
    used = item < items_end[-1]
    # compare_all: one fused kernel on a GPU (the default binary search is a loop of a few kernels a step).
    group = jnp.minimum(jnp.searchsorted(items_end, item, side="right", method="compare_all"), e - 1).astype(I32)
    tile = starts[group] // bm + item - (items_end[group] - tiles_of_group[group])
    per_item = (tile, expert_offset + group, starts[group], ends[group])
    return (items_end[-1:], *(jnp.where(used, a, 0).astype(I32) for a in per_item))


def _kernel(
    count_ref, tile_ref, expert_ref, start_ref, end_ref, x_ref, *refs, layout: _Layout, n_w: int, normed: bool,
    eps: float,
):  # fmt: skip
    """Program (item, f tile): out[tile rows in the group, f tile] = x[tile rows] @ W[expert][:, f tile], x's rows
    normalised first if `normed` (the norm's stack and row are the refs before out)."""
    w_refs, out_ref = refs[:n_w], refs[-1]  # any ref between: zeros aliased to out, the norm's refs
    item, f_tile = pl.program_id(0), pl.program_id(1)  # outside pl.when: interpret mode can't lower it inside
    lo = layout

    @pl.when(item < count_ref[0])
    def _():
        tile, expert = tile_ref[item], expert_ref[item]
        row0, col0 = tile * lo.bm, f_tile * lo.bf
        rows = row0 + lax.broadcasted_iota(I32, (lo.bm, 1), 0)
        cols = col0 + lax.broadcasted_iota(I32, (1, lo.bf), 1)

        def x_mask(k0):
            return (rows < lo.m) & (k0 + lax.broadcasted_iota(I32, (1, lo.bkc), 1) < lo.kc)

        if normed:  # a first pass sums the rows' squares
            norm_ref, norm_row_ref = refs[-3], refs[-2]
            norm_rows = jnp.full((lo.bm, 1), norm_row_ref[0], I32)

            def add_squares(step, squares):
                tiles = x_tiles(x_ref, rows, step * lo.bkc, x_mask(step * lo.bkc), lo)
                return squares + sum(jnp.sum(jnp.square(t.astype(F32)), axis=1, keepdims=True) for t in tiles)

            squares = lax.fori_loop(0, lo.k_steps, add_squares, jnp.zeros((lo.bm, 1), F32))
            inv_rms = lax.rsqrt(squares / (lo.kc * lo.halves) + eps)

        def loaded(k0):
            """x's tile(s) at k0, normalised as the reference's rms_norm rounds them if `normed`."""
            tiles = x_tiles(x_ref, rows, k0, x_mask(k0), lo)
            if not normed:
                return tiles
            weights = x_tiles(norm_ref, norm_rows, k0, x_mask(k0), lo)
            return [(t.astype(F32) * inv_rms * w.astype(F32)).astype(t.dtype) for t, w in zip(tiles, weights)]

        def k_step(step, acc):
            k0 = step * lo.bkc
            w_mask = (k0 + lax.broadcasted_iota(I32, (lo.bkc, 1), 0) < lo.kc) & (cols < lo.f)
            w_tiles = _weight_tiles(w_refs, expert, k0, col0, w_mask, lo)
            for x_tile, w_tile in zip(loaded(k0), w_tiles, strict=True):
                acc += jnp.dot(
                    x_tile.astype(lo.compute_dtype), w_tile, preferred_element_type=F32, precision=lax.Precision.HIGHEST
                )  # float32 inputs: IEEE, not TF32
            return acc

        acc = lax.fori_loop(0, lo.k_steps, k_step, jnp.zeros((lo.bm, lo.bf), F32))
        mine = (rows >= start_ref[item]) & (rows < end_ref[item]) & (cols < lo.f)
        plgpu.store(out_ref.at[pl.ds(row0, lo.bm), pl.ds(col0, lo.bf)], acc.astype(out_ref.dtype), mask=mine)


def _weight_tiles(w_refs, expert, k0, col0, mask, lo: _Layout) -> list[jax.Array]:
    """The expert's weight tile(s) at code rows k0.., columns col0.., decoded to the compute dtype: one [bkc, bf]
    tile (plain, FP8) or the low- and high-nibble tiles (FP4). Out-of-range elements come out 0."""
    window = (expert, pl.ds(k0, lo.bkc), pl.ds(col0, lo.bf))
    if lo.fmt is None:
        return [plgpu.load(w_refs[0].at[window], mask=mask, other=0).astype(lo.compute_dtype)]
    codes_ref, scales_ref = w_refs
    # `other` typed as the codes: the Triton lowering cannot cast an int 0 to float8.
    codes = plgpu.load(codes_ref.at[window], mask=mask, other=jnp.zeros((), codes_ref.dtype))
    scale = _scale_tile(scales_ref, expert, k0, col0, lo)
    if lo.fmt == FP8:
        byte = lax.bitcast_convert_type(codes, jnp.uint8).astype(I32)
        return [(_e4m3_values(byte) * scale).astype(lo.compute_dtype)]
    byte = codes.astype(I32)
    return [(_e2m1_values(nibble) * scale).astype(lo.compute_dtype) for nibble in (byte & 0xF, byte >> 4)]


def _scale_tile(scales_ref, expert, k0, col0, lo: _Layout) -> jax.Array:
    """The float32 scale of every element of the [bkc, bf] weight tile at code rows k0.., columns col0..: the few
    ue8m0 bytes of the blocks it spans, decoded, then each repeated over its block's part of the tile."""
    (n_rows, n_cols), (block_rows, block_cols) = lo.scale_tile, lo.scale_block
    r0, c0 = k0 // block_rows, col0 // block_cols
    mask = (r0 + lax.broadcasted_iota(I32, (n_rows, 1), 0) < lo.scale_shape[0]) & (
        c0 + lax.broadcasted_iota(I32, (1, n_cols), 1) < lo.scale_shape[1]
    )
    ue8m0 = plgpu.load(scales_ref.at[expert, pl.ds(r0, n_rows), pl.ds(c0, n_cols)], mask=mask, other=SCALE_BIAS)
    scale = _ue8m0_values(ue8m0.astype(I32))
    repeated = jnp.broadcast_to(scale[:, None, :, None], (n_rows, lo.bkc // n_rows, n_cols, lo.bf // n_cols))
    return repeated.reshape(lo.bkc, lo.bf)


def _ue8m0_values(u: jax.Array) -> jax.Array:
    """ue8m0 bytes (int32 0..255) -> 2^(u - 127) in float32, built from its bits: exponent field u, except 2^-127,
    below float32's normal range (a denormal: mantissa's top bit), and 255, which the format defines as NaN."""
    bits = jnp.where(u == 0, 1 << 22, u << 23)
    return jnp.where(u == 255, jnp.nan, lax.bitcast_convert_type(bits, F32))


def _e2m1_values(nibble: jax.Array) -> jax.Array:
    """e2m1 codes (int32 0..15: sign, 2 exponent bits, 1 mantissa bit) -> float32, built from the bits since there
    is no FP4 convert to rely on. Exponent field x > 0: 2^(x-1) (1 + m/2), float32 exponent field x + 126;
    x = 0: m / 2, i.e. 0.5 (0x3F000000) or 0."""
    exponent, mantissa = (nibble >> 1) & 3, nibble & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    magnitude = jnp.where(exponent == 0, mantissa * 0x3F000000, normal)
    return lax.bitcast_convert_type(((nibble & 8) << 28) | magnitude, F32)


def _e4m3_values(byte: jax.Array) -> jax.Array:
    """e4m3fn codes (int32 0..255: sign, 4 exponent bits with bias 7, 3 mantissa bits) -> float32. Normal codes
    become float32 bits (exponent field x + 120); subnormals (x = 0) are m 2^-9, computed in float so no float32
    denormal is involved; S.1111.111 is NaN (e4m3fn has no infinities)."""
    exponent, mantissa = (byte >> 3) & 15, byte & 7
    normal = lax.bitcast_convert_type(((exponent + 120) << 23) | (mantissa << 20), F32)
    magnitude = jnp.where(exponent == 0, mantissa.astype(F32) * 2.0**-9, normal)
    magnitude = jnp.where((byte & 0x7F) == 0x7F, jnp.nan, magnitude)
    return jnp.where(byte >= 0x80, -magnitude, magnitude)
