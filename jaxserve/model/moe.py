"""Mixture of experts: sqrt-softplus router (top-k with a selection-only bias, or the fixed hash table),
renormalised weights times the routing scale, clamped SwiGLU routed experts plus one shared expert.

Letters: n tokens, d embed, e experts, f expert width, a assignments (n * top-k).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.kernels.moe import EXPERT_ROWS_MAX, clamped_swiglu
from jaxserve.kernels.table import Kernels
from jaxserve.model.sharding import expert_axes, logical_spec
from jaxserve.model.weights import MoE, RoutedExperts

F32 = jnp.float32


def route(x: jax.Array, tokens: jax.Array, w: MoE, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """x [n, d] -> (expert ids [n, k] int32, weights [n, k] float32)."""
    logits = jnp.einsum("nd,de->ne", x.astype(F32), w.router.astype(F32))
    scores = jnp.sqrt(jax.nn.softplus(logits))
    if w.tid2eid is not None:
        experts = w.tid2eid[tokens]
    else:
        _, experts = jax.lax.top_k(scores + w.score_bias.astype(F32), cfg.num_experts_per_tok)
    picked = jnp.take_along_axis(scores, experts, axis=1)
    weights = picked / (jnp.sum(picked, axis=1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    return experts.astype(jnp.int32), weights


# Where sorting a step's routed rows into groups starts to pay: the embedded default's forward on CPU (8 experts, top
# 2; paired in one process) took 6.8 -> 5.1 ms for 5 tokens (10 rows) and 6.4 -> 5.7 ms for 8 (16 rows) without the
# sort, but 10.0 ms against 9.0 sorted for 16 tokens (32 rows). With one row an expert at most, a DSpark verify of 4+
# drafts at batch 1 (5+ tokens) paid the sort. Models of 32 experts or more are bound by EXPERT_ROWS_MAX instead.
EXPERT_ROWS_PER_EXPERT = 2


def _flat_layers(stack: Any) -> Any:
    """A stack of layers' experts [layers, e, ...] as one run of experts [layers * e, ...] (a free reshape), codes and
    scales alike."""
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stack)


def _local_experts(
    x, local_ids, weights, stacks: tuple, layer: jax.Array, cfg: ModelConfig, kernels: Kernels, all_local: bool
) -> jax.Array:
    """Assignments to experts [0, n_local) of layer `layer` of the given stacks ([layers, n_local, ...] each: w_gate,
    w_up, w_down); others contribute nothing. `all_local`: every assignment is to these experts (no expert
    parallelism), so every sorted row is in a group."""
    limit = cfg.swiglu_limit
    n, k = local_ids.shape
    n_local = stacks[0].shape[1]
    w_gate, w_up, w_down = (_flat_layers(stack) for stack in stacks)
    offset = layer * n_local  # where this layer's experts start in the flat run
    flat = local_ids.reshape(-1)
    mine = (flat >= 0) & (flat < n_local)
    # Decode-sized (few rows, at most EXPERT_ROWS_PER_EXPERT an expert): the rows in token order with their experts,
    # no sort, no groups. More rows an expert are cheaper sorted into groups.
    if n * k <= min(EXPERT_ROWS_MAX, EXPERT_ROWS_PER_EXPERT * cfg.n_routed_experts):
        experts = jnp.where(mine, offset + flat, -1)  # -1: another device's expert, no row of this one
        hidden = kernels.expert_rows(x, (w_gate, w_up), experts, swiglu_limit=limit, out_dtype=x.dtype, repeats=k)
        out = jnp.where(mine[:, None], kernels.expert_rows(hidden, (w_down,), experts, out_dtype=x.dtype), 0)
        out = out * weights.reshape(-1, 1).astype(x.dtype)
        return out.astype(F32).reshape(n, k, -1).sum(axis=1)
    flat = jnp.where(mine, flat, n_local)  # foreign assignments sort last, into no group
    order = jnp.argsort(flat, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat, length=n_local + 1)[:n_local]
    xs = x[token_of]
    grouped = functools.partial(kernels.grouped_matmul, every_row_grouped=all_local)
    gate = grouped(xs, w_gate, group_sizes, offset)
    up = grouped(xs, w_up, group_sizes, offset)
    hidden = clamped_swiglu(gate, up, limit).astype(x.dtype)
    out = grouped(hidden, w_down, group_sizes, offset, out_dtype=x.dtype)
    scale = jnp.where(mine, weights.reshape(-1), 0.0)[order]
    out = out * scale[:, None].astype(x.dtype)
    return jnp.zeros((n, x.shape[1]), F32).at[token_of].add(out.astype(F32))


def routed_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    stacks: RoutedExperts,
    layer: jax.Array,
    cfg: ModelConfig,
    kernels: Kernels,
) -> jax.Array:
    """Run each (token, expert) assignment through its expert and sum a token's back, weighted: a decode step's few
    assignments (at most EXPERT_ROWS_MAX, and EXPERT_ROWS_PER_EXPERT an expert) in token order through
    `expert_rows`; more are sorted by expert into groups for `grouped_matmul` and scattered back. `stacks` holds
    every layer of the segment ([layers, E, ...]); layer `layer`'s experts are read in place.

    Under a mesh whose expert axes divide the experts, each device runs only its own experts (routing is
    replicated) and the partial outputs are summed over the expert axes: explicit expert parallelism.
    """
    mesh = jax.sharding.get_abstract_mesh()
    axes = expert_axes()
    ways = 1 if mesh.empty else int(np.prod([mesh.shape[a] for a in axes]))
    stacked = (stacks.w_gate, stacks.w_up, stacks.w_down)
    if ways == 1 or cfg.n_routed_experts % ways:
        out = _local_experts(x, experts, weights, stacked, layer, cfg, kernels, all_local=True)
        return out.astype(x.dtype)

    def per_device(x, experts, weights, layer, w_gate, w_up, w_down):
        first = jax.lax.axis_index(axes) * w_gate.shape[1]
        partial = _local_experts(
            x, experts - first, weights, (w_gate, w_up, w_down), layer, cfg, kernels, all_local=False
        )
        return jax.lax.psum(partial, axes)

    replicated = logical_spec((None, None))
    per_layer = logical_spec((None, "experts", None, None))
    out = jax.shard_map(
        per_device,
        in_specs=(replicated, replicated, replicated, logical_spec(()), per_layer, per_layer, per_layer),
        out_specs=replicated,
    )(x, experts, weights, layer, *stacked)
    return out.astype(x.dtype)


def shared_expert(x: jax.Array, w: MoE, cfg: ModelConfig, kernels: Kernels) -> jax.Array:
    hidden = kernels.gated_matmul(x, w.shared_gate, w.shared_up, cfg.swiglu_limit)
    return kernels.einsum("nf,fd->nd", hidden, w.shared_down)


def moe_block(
    x: jax.Array, tokens: jax.Array, w: MoE, stacks: RoutedExperts, layer: jax.Array, cfg: ModelConfig, kernels: Kernels
) -> jax.Array:
    """x [b, t, d], tokens [b, t] -> [b, t, d]. `w` is this layer's (its routed experts aside); `stacks` the
    segment's routed experts, of which layer `layer`'s run."""
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    with jax.named_scope("router"):
        experts, weights = route(flat, tokens.reshape(-1), w, cfg)
    with jax.named_scope("routed_experts"):
        routed = routed_experts(flat, experts, weights, stacks, layer, cfg, kernels)
    with jax.named_scope("shared_expert"):
        shared = shared_expert(flat, w, cfg, kernels)
    return (routed + shared).reshape(b, t, d)
