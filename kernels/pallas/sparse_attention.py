"""Pallas sink attention: `jaxserve.kernels.attention.sink_attention` as one flash-attention-style kernel.

The reference builds [b, t, h, s + j + 1] logits and softmaxes them. Here each program owns one query of one row
and a block of its heads, keeps an online softmax (running max m, running sum l, unnormalised output acc) in
float32, and streams its keys in blocks: first the row's shared keys, then the query's own selected keys. K = V, so
one load of a key block serves both dots. No logits ever reach HBM.

Grid (b, t, head blocks). A program reads q[row, query, head block] once, the row's shared keys [s, k] and its
query's mask row [s], then the query's selected keys [j, k] and mask [j], and writes out[row, query, head block].

The sink is a logit with no value: it seeds the running state (m = sink, l = exp(sink - m) = 1, acc = 0), which is
the reference's softmax over [logits, sink] with the sink's weight left out of the output. Seeding keeps m finite
from the start, so blocks whose keys are all masked need no -inf special case, and a query with no unmasked key
comes out as acc / l = 0 / 1 = 0 -- the reference's answer (all weight on the sink). Sinks must be finite (the
model's are learned parameters); the reference's own result for a sink near float32's lowest value is degenerate.

Numerics: q . K^T runs in the inputs' dtype with float32 accumulation when q and the keys share a dtype (bfloat16
products are exact in float32, so this equals the reference's upcast), else in float32; the probabilities stay
float32 and the keys are upcast for p . K, so every sum is float32 as in the reference. Output in q's dtype.

DeepSeek-V4's query norm and rotary embedding (a `QueryRotation`): the program normalises its q heads (RMS over k, in
float32, rounded to q's dtype as the reference's rms_norm) and rotates them as it loads them, x[c] cos[c] + x[c ^ 1]
sin[c] over the tables of kernels.rope at the query's position (its row of the [b, t, 2, k] tables, which XLA builds
once per step and layer kind), the partner elements c ^ 1 loaded from q's block by index. The output's inverse
rotation is linear and the same for every key of the program, so it is applied to each value block instead (the
partner columns of the key block loaded by index, L1-resident): sum_s p_s R^-1 v_s = R^-1 sum_s p_s v_s. The output
is rounded once, where the reference rounds before its rotation and after: a bfloat16 ulp apart at most.

Sinks are one layer's, or read in place from a stack of layers (a `LayerOf`: the layer an operand; a slice of the
stack would be one more launch a layer).

Tails: s, j and h need not be multiples of their blocks: out-of-range keys, mask entries and heads are loaded
masked (keys as 0, mask as False) and out-of-range heads are not stored, so nothing is padded in HBM.

Unverified without a GPU (every test runs with interpret=True on CPU): that this lowers through Triton and its
speed. Written for that lowering: block sizes are powers of two and >= 16 (Triton's dot minimum), loads and stores
go through `plgpu.load` / `plgpu.store` masks, the head dim k must be a power of two there (DeepSeek-V4: 512).
The defaults (16 heads, 32 keys per block, 4 warps, 2 stages) are guesses sized so the float32 accumulator
[16, 512] and an upcast key block [32, 512] fit in registers; p . K in float32 is IEEE (no tensor cores) in that
lowering, a cost to measure against casting p to the key dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..attention import QueryRotation
from ..quant import layer_stacks
from ..rope import rotation_tables

F32 = jnp.float32


def sink_attention(
    q: jax.Array,  # [b, t, h, k]
    shared: jax.Array,  # [b, s, k]
    shared_mask: jax.Array,  # [b, t, s] bool
    sinks: Any,  # [h], or a LayerOf of a stack [layers, h]
    selected: jax.Array | None = None,  # [b, t, j, k]
    selected_mask: jax.Array | None = None,  # [b, t, j] bool
    rotation: QueryRotation | None = None,
    *,
    interpret: bool = False,
    block_h: int = 16,
    block_s: int = 32,
    block_j: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """softmax([q.K^T * k^-0.5, sink]) without the sink's column, times K. Returns [b, t, h, k] in q's dtype.

    Same contract as `jaxserve.kernels.attention.sink_attention`; block_h heads, block_s shared keys and block_j
    selected keys per step (powers of two, >= 16). num_warps / num_stages go to Triton and are ignored when
    interpreting.
    """
    for name, block in (("block_h", block_h), ("block_s", block_s), ("block_j", block_j)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name}={block}: the Triton lowering needs a power of two >= 16")
    if selected is not None and selected_mask is None:
        raise ValueError("selected keys need selected_mask")
    (sinks,), layer = layer_stacks(sinks)
    tables = None
    if rotation is not None:  # cos and sin as one array [b, t, 2, k]: made by one XLA kernel
        tables = jnp.stack(rotation_tables(rotation.positions, rotation.freqs, q.shape[-1]), axis=2)
    return _sink_attention(
        q,
        shared,
        shared_mask,
        sinks,
        layer,
        selected,
        selected_mask,
        tables,
        norm_eps=None if rotation is None else rotation.norm_eps,
        interpret=interpret,
        block_h=block_h,
        block_s=block_s,
        block_j=block_j,
        num_warps=num_warps,
        num_stages=num_stages,
    )


@functools.partial(
    jax.jit, static_argnames=("norm_eps", "interpret", "block_h", "block_s", "block_j", "num_warps", "num_stages")
)
def _sink_attention(
    q,
    shared,
    shared_mask,
    sinks,
    layer,
    selected,
    selected_mask,
    tables,
    *,
    norm_eps,
    interpret,
    block_h,
    block_s,
    block_j,
    num_warps,
    num_stages,
):
    b, t, h, k = q.shape
    s = shared.shape[1]
    in_specs = [
        pl.BlockSpec((1,), lambda row, query, heads: (0,)),  # the sinks' layer
        pl.BlockSpec((None, None, block_h, k), _head_block),  # q
        pl.BlockSpec(sinks.shape, lambda row, query, heads: (0, 0)),  # the sinks' stack, whole
    ]
    operands = [layer, q, sinks]
    if tables is not None:  # cos and sin: this query's rows [2, k]
        in_specs.append(pl.BlockSpec((None, None, 2, k), lambda row, query, heads: (row, query, 0, 0)))
        operands.append(tables)
    in_specs += [
        pl.BlockSpec((None, s, k), lambda row, query, heads: (row, 0, 0)),  # shared keys: the whole row
        pl.BlockSpec((None, None, s), lambda row, query, heads: (row, query, 0)),  # this query's shared mask
    ]
    operands += [shared, shared_mask]
    key_blocks = [block_s]
    if selected is not None:
        j = selected.shape[2]
        in_specs += [
            pl.BlockSpec((None, None, j, k), lambda row, query, heads: (row, query, 0, 0)),  # this query's picks
            pl.BlockSpec((None, None, j), lambda row, query, heads: (row, query, 0)),
        ]
        operands += [selected, selected_mask]
        key_blocks.append(block_j)
    kernel = functools.partial(
        _kernel, num_heads=h, block_h=block_h, key_blocks=tuple(key_blocks), scale=k**-0.5, norm_eps=norm_eps
    )
    return pl.pallas_call(
        kernel,
        grid=(b, t, pl.cdiv(h, block_h)),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, block_h, k), _head_block),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*operands)


def _head_block(row, query, heads):
    """Block index of q and of the output for program (row, query, head block)."""
    return row, query, heads, 0


def _kernel(layer_ref, q_ref, sinks_ref, *refs, num_heads, block_h, key_blocks, scale, norm_eps):
    """One (row, query, head block): refs are the rotation's cos and sin rows [2, k] (with a rotation: `norm_eps` not
    None), (keys, mask) per key group, then the output block [block_h, k]."""
    *group_refs, out_ref = refs
    first_head = pl.program_id(2) * block_h
    head_in_range = first_head + jnp.arange(block_h) < num_heads  # the last head block may overhang h
    q = plgpu.load(q_ref, mask=head_in_range[:, None], other=0)
    sinks = sinks_ref.at[layer_ref[0], pl.ds(first_head, block_h)]
    sink = plgpu.load(sinks, mask=head_in_range, other=0).astype(F32)
    inverse = None
    if norm_eps is not None:
        tables_ref, *group_refs = group_refs
        cos, sin = (tables_ref[i, :][None, :] for i in range(2))
        partner = lax.bitwise_xor(lax.broadcasted_iota(jnp.int32, (1, q.shape[1]), 1), 1)  # c ^ 1
        heads = lax.broadcasted_iota(jnp.int32, (block_h, 1), 0)
        q_partner = plgpu.load(q_ref.at[heads, partner], mask=head_in_range[:, None], other=0)
        inv_rms = lax.rsqrt(jnp.mean(jnp.square(q.astype(F32)), axis=1, keepdims=True) + norm_eps)

        def normed(x):  # as the reference's rms_norm rounds it
            return (x.astype(F32) * inv_rms).astype(q.dtype).astype(F32)

        q = (normed(q) * cos + normed(q_partner) * sin).astype(q.dtype)
        inverse = (cos, -sin, partner)
    state = (sink, jnp.ones_like(sink), jnp.zeros(q.shape, F32))  # (m, l, acc) with the sink already counted
    for group, block in enumerate(key_blocks):
        keys_ref, mask_ref = group_refs[2 * group : 2 * group + 2]
        state = _attend_key_group(q, keys_ref, mask_ref, state, block=block, scale=scale, inverse=inverse)
    _, total, acc = state
    plgpu.store(out_ref, (acc / total[:, None]).astype(out_ref.dtype), mask=head_in_range[:, None])


def _attend_key_group(q, keys_ref, mask_ref, state, *, block, scale, inverse):
    """Folds the keys of one group ([n, k], mask [n]) into the online softmax state, `block` keys per step; the
    values rotated by `inverse` (cos, sin, partner columns) if given."""
    n = keys_ref.shape[0]

    def step(i, state):
        start = i * block
        key_in_range = start + jnp.arange(block) < n  # the last block may overhang n
        keys = plgpu.load(keys_ref.at[pl.ds(start, block), :], mask=key_in_range[:, None], other=0)
        keep = plgpu.load(mask_ref.at[pl.ds(start, block)], mask=key_in_range, other=False)
        values = keys.astype(F32)
        if inverse is not None:
            cos, sin, partner = inverse
            rows = start + lax.broadcasted_iota(jnp.int32, (block, 1), 0)
            partners = plgpu.load(keys_ref.at[rows, partner], mask=key_in_range[:, None], other=0)
            values = values * cos + partners.astype(F32) * sin
        return _online_softmax_step(_logits(q, keys) * scale, keep, values, state)

    return jax.lax.fori_loop(0, pl.cdiv(n, block), step, state)


def _logits(q, keys):
    """q [h, k] . keys [n, k]^T -> [h, n] float32; in the inputs' dtype when shared (exact products for bf16)."""
    if q.dtype != keys.dtype:
        q, keys = q.astype(F32), keys.astype(F32)
    return jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _online_softmax_step(logits, keep, values, state):
    """Adds one key block (logits [h, n], keep [n], values [n, k] float32) to (running max, running sum, unnormalised
    out)."""
    running_max, total, acc = state
    block_max = jnp.max(jnp.where(keep[None, :], logits, -jnp.inf), axis=1)
    new_max = jnp.maximum(running_max, block_max)  # finite: running_max starts at the sink
    rescale = jnp.exp(running_max - new_max)  # earlier terms were exponentiated against the old max
    # where, not exp(-inf): a masked key must add exactly nothing, whatever its logit
    probs = jnp.where(keep[None, :], jnp.exp(logits - new_max[:, None]), 0.0)
    acc = acc * rescale[:, None] + jnp.dot(probs, values, preferred_element_type=F32)
    return new_max, total * rescale + jnp.sum(probs, axis=1), acc
