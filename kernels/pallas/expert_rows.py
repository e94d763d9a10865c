"""Pallas routed rows: `jaxserve.kernels.moe.expert_rows`, a decode step's routed experts without sorting its rows.

Letters: a routed rows (tokens x top-k, in token order), d input features, f output features, n experts in the
stack; bm >= a the row block (a power of two, at least 16), bk, bf the input and output tiles.

The grouped kernel (`grouped_matmul.py`) needs its rows sorted by expert and work items made from the group sizes:
on a GPU the sort, the counts, the sorted copy of the rows, the work-item arrays and the scatter back to the tokens
are ten small kernels a layer around three matmul launches. A decode step has few rows (at most EXPERT_ROWS_MAX), so
this kernel takes them in token order with their expert indices and finds the groups itself. Program (r, j), r a
row: it loads every row's expert index ([bm], a few bytes), and only if row r is the first of its expert (no
earlier row has the same index, and the index is in [0, n)) it computes, for f tile j,

    out[rows of that expert, tile j] = x[rows of that expert] @ W[expert][:, tile j]

over all of d in steps of bk: the x tile is loaded for the whole block of rows with the other experts' rows masked
(so masked rows cost no memory traffic and contribute zero), the weight tile decoded in registers exactly as in the
grouped kernel (`_weight_tiles`: FP8 e4m3 and FP4 e2m1 codes and ue8m0 scales from their bits). It stores only its
expert's rows, so each row is written by one program: no races, and rows of no expert are never written (the
reference's "unspecified": callers mask them). Each touched expert's codes are read once; the other programs
return after reading the index array.

With two stacks (gate, up) and a swiglu_limit the program keeps two accumulators and stores
`silu(min(gate, limit)) * clip(up, -limit, limit)`: the routed FFN's first half in one launch, the hidden
activations never stored twice or re-read in float32.

The price: each program's dot is [bm, bk] x [bk, bf] though only its expert's rows are non-zero, so a step's dot
work is (touched experts) x bm x d x f, bm up to 64, where the grouped kernel's is (work items) x 16 x d x f; a
decode step is bound by the experts' bytes, and EXPERT_ROWS_MAX keeps the waste at most 4x the grouped form's.
Unverified without a GPU: any run and its speed; the tiles and num_warps are the grouped kernel's guesses.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..moe import EXPERT_ROWS_MAX, clamped_swiglu
from .block_scaled_matmul import einsum, expert_view
from .grouped_matmul import _Layout, _operands, _weight_tiles, x_tiles

F32 = jnp.float32
I32 = jnp.int32


@functools.partial(
    jax.jit,
    static_argnames=(
        "swiglu_limit", "out_dtype", "repeats", "interpret", "block_k", "block_f", "num_warps", "num_stages"
    ),
)  # fmt: skip
def expert_rows(
    x: jax.Array,
    stacks: tuple[Any, ...],
    experts: jax.Array,
    *,
    swiglu_limit: float | None = None,
    out_dtype: Any = F32,
    repeats: int = 1,
    interpret: bool = False,
    block_k: int = 128,
    block_f: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """As the reference: x [a / repeats, d] (assignment i reads row i // repeats, in place), one stack [n, d, f] or
    two (gate, up) with `swiglu_limit`, experts [a] -> [a, f] in `out_dtype`; rows whose index is outside [0, n) are
    left unwritten."""
    a = experts.shape[0]
    if x.shape[0] * repeats != a:
        raise ValueError(f"{a} expert indices for {x.shape[0]} rows of x, each {repeats} times")
    if a > EXPERT_ROWS_MAX:
        raise ValueError(f"expert_rows takes at most {EXPERT_ROWS_MAX} rows (a decode step's); got {a}")
    if (len(stacks) == 2) != (swiglu_limit is not None):
        raise ValueError("expert_rows takes one stack, or two (gate, up) with a swiglu_limit")
    bm = max(16, pl.next_power_of_2(a))
    layouts: list[_Layout] = []
    w_operands: list[jax.Array] = []
    for w in stacks:
        layout, operands = _operands(x, w, bm, block_k, block_f)
        layouts.append(dataclasses.replace(layout, m=a))
        w_operands.extend(operands)
    if any(layout != layouts[0] for layout in layouts) or len({w.shape for w in stacks}) > 1:
        raise ValueError(f"the gate and up stacks must have one shape and format; got {[w.shape for w in stacks]}")
    f = stacks[0].shape[-1]
    varying = jax.typeof(w_operands[0]).manual_axis_type  # under shard_map, as the expert stack
    return pl.pallas_call(
        functools.partial(
            _kernel,
            layout=layouts[0],
            n_stacks=len(stacks),
            n_experts=stacks[0].shape[0],
            swiglu_limit=swiglu_limit,
            repeats=repeats,
        ),
        out_shape=jax.ShapeDtypeStruct((a, f), out_dtype, manual_axis_type=varying),
        grid=(a, pl.cdiv(f, layouts[0].bf)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="expert_rows",
    )(experts.astype(I32), x, *w_operands)


def hbm_bytes(operand_shapes: list[tuple[int, ...]], operand_bytes: list[float], out_bytes: float) -> float:
    """The most HBM bytes one call moves, from its operands as compiled, in order: the expert indices [a], x [a /
    repeats, d], then each stack's weights (a plain stack, or codes and scales: [n, ...]). Each touched expert's
    weights once, at most min(rows, stack) experts; x read and the output written once; the index array once a
    program (it is a few bytes)."""
    rows, stack = operand_shapes[0][0], operand_shapes[2][0]
    per_expert = sum(operand_bytes[2:]) / stack
    return experts_read_at_most(rows, stack) * per_expert + operand_bytes[1] + out_bytes + rows * operand_bytes[0]


def experts_read_at_most(rows: int, stack: int) -> int:
    """Expert loads of one call: one per row that is the first of its expert."""
    return min(rows, stack)


def _kernel(experts_ref, x_ref, *refs, layout: _Layout, n_stacks: int, n_experts: int, swiglu_limit, repeats: int):
    """Program (row, f tile): if the row is the first of its expert, that expert's rows times its matrices."""
    lo = layout
    out_ref = refs[-1]
    n_w = (len(refs) - 1) // n_stacks
    w_sets = [refs[i * n_w : (i + 1) * n_w] for i in range(n_stacks)]
    row, f_tile = pl.program_id(0), pl.program_id(1)  # outside pl.when: interpret mode can't lower it inside
    index = lax.broadcasted_iota(I32, (lo.bm,), 0)
    ids = plgpu.load(experts_ref.at[pl.ds(0, lo.bm)], mask=index < lo.m, other=-1)
    expert = experts_ref[row]
    earlier = jnp.sum(((ids == expert) & (index < row)).astype(I32))

    @pl.when((expert >= 0) & (expert < n_experts) & (earlier == 0))
    def _():
        col0 = f_tile * lo.bf
        cols = col0 + lax.broadcasted_iota(I32, (1, lo.bf), 1)
        mine = (ids == expert)[:, None]  # [bm, 1]: the rows of this expert (rows past a hold -1)

        def k_step(step, accs):
            k0 = step * lo.bkc
            x_mask = mine & (k0 + lax.broadcasted_iota(I32, (1, lo.bkc), 1) < lo.kc)
            w_mask = (k0 + lax.broadcasted_iota(I32, (lo.bkc, 1), 0) < lo.kc) & (cols < lo.f)
            tiles = x_tiles(x_ref, index[:, None] // repeats, k0, x_mask, lo)
            out = []
            for acc, w_refs in zip(accs, w_sets, strict=True):
                for x_tile, w_tile in zip(tiles, _weight_tiles(w_refs, expert, k0, col0, w_mask, lo), strict=True):
                    acc += jnp.dot(
                        x_tile.astype(lo.compute_dtype), w_tile, preferred_element_type=F32,
                        precision=lax.Precision.HIGHEST,
                    )  # fmt: skip
                out.append(acc)
            return tuple(out)

        zeros = jnp.zeros((lo.bm, lo.bf), F32)
        accs = lax.fori_loop(0, lo.k_steps, k_step, (zeros,) * n_stacks)
        out = accs[0] if swiglu_limit is None else clamped_swiglu(accs[0], accs[1], swiglu_limit)
        tile = out_ref.at[pl.ds(0, lo.bm), pl.ds(col0, lo.bf)]
        plgpu.store(tile, out.astype(out_ref.dtype), mask=mine & (cols < lo.f))


def gated_matmul(x: jax.Array, w_gate: Any, w_up: Any, swiglu_limit: float, *, interpret: bool = False) -> jax.Array:
    """`jaxserve.kernels.moe.gated_matmul` (the shared expert's gate, up and SwiGLU): up to EXPERT_ROWS_MAX rows, one
    `expert_rows` launch with the two projections as an expert every row uses (as the block-scaled matmul would read
    them: `block_scaled_matmul.expert_view`, a `LayerOf` in place from its stack; the SwiGLU on the float32 sums,
    rounded once to x's dtype, where the reference rounds each product first); otherwise, or for weights the expert
    kernels do not take, the reference's form over the Pallas einsum."""
    gate_view, up_view = (expert_view("nd,df->nf", x, w) for w in (w_gate, w_up))
    if (
        x.ndim == 2
        and x.shape[0] <= EXPERT_ROWS_MAX
        and gate_view
        and up_view
        and gate_view[0].shape == up_view[0].shape
    ):
        experts = jnp.full((x.shape[0],), gate_view[1], I32)
        stacks = (gate_view[0], up_view[0])
        return expert_rows(x, stacks, experts, swiglu_limit=swiglu_limit, out_dtype=x.dtype, interpret=interpret)
    gate_out = einsum("nd,df->nf", x, w_gate, interpret=interpret)
    up_out = einsum("nd,df->nf", x, w_up, interpret=interpret)
    return clamped_swiglu(gate_out, up_out, swiglu_limit)
