"""Mixture of experts: sqrt-softplus router (top-k with a selection-only bias, or the fixed hash table),
renormalised weights times the routing scale, clamped SwiGLU routed experts plus one shared expert.

Letters: n tokens, d embed, e experts, f expert width, a assignments (n * top-k).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.weights import MoE
from kernels.moe import grouped_matmul

F32 = jnp.float32


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


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


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, w: MoE, cfg: ModelConfig) -> jax.Array:
    """Sort the (token, expert) assignments by expert, run each group through its expert, scatter back."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat, length=cfg.n_routed_experts)
    xs = x[token_of]
    gate = grouped_matmul(xs, w.w_gate, group_sizes)
    up = grouped_matmul(xs, w.w_up, group_sizes)
    hidden = clamped_swiglu(gate, up, cfg.swiglu_limit).astype(x.dtype)
    out = grouped_matmul(hidden, w.w_down, group_sizes).astype(x.dtype)
    out = out * weights.reshape(-1)[order][:, None].astype(x.dtype)
    return jnp.zeros((n, x.shape[1]), F32).at[token_of].add(out.astype(F32)).astype(x.dtype)


def shared_expert(x: jax.Array, w: MoE, cfg: ModelConfig) -> jax.Array:
    gate = jnp.einsum("nd,df->nf", x, w.shared_gate)
    up = jnp.einsum("nd,df->nf", x, w.shared_up)
    return jnp.einsum("nf,fd->nd", clamped_swiglu(gate, up, cfg.swiglu_limit), w.shared_down)


def moe_block(x: jax.Array, tokens: jax.Array, w: MoE, cfg: ModelConfig) -> jax.Array:
    """x [b, t, d], tokens [b, t] -> [b, t, d]."""
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    with jax.named_scope("router"):
        experts, weights = route(flat, tokens.reshape(-1), w, cfg)
    with jax.named_scope("routed_experts"):
        routed = routed_experts(flat, experts, weights, w, cfg)
    with jax.named_scope("shared_expert"):
        shared = shared_expert(flat, w, cfg)
    return (routed + shared).reshape(b, t, d)
