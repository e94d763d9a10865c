"""The whole DeepSeek-V4 forward over a chunk per row: embed into hc streams, blocks, hc_head, norm, head.

Pure: (weights, cache, inputs) -> (outputs, cache). Decode is a chunk of length 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.cache import LayerCache
from jaxserve.config import ModelConfig
from jaxserve.model.attention import attention_block
from jaxserve.model.inputs import StepInputs
from jaxserve.model.layers import hc_head, hc_post, hc_pre, rms_norm
from jaxserve.model.moe import moe_block
from jaxserve.model.weights import Layer, Weights

F32 = jnp.float32


def block(h: jax.Array, w: Layer, cache: LayerCache, inputs: StepInputs, cfg: ModelConfig, layer: int):
    with jax.named_scope("attention"):
        x, post, comb = hc_pre(h, w.attn_hc, cfg)
        out, cache = attention_block(rms_norm(x, w.attn_norm, cfg.rms_norm_eps), w.attn, cache, inputs, cfg, layer)
        h = hc_post(out, h, post, comb)
    with jax.named_scope("moe"):
        x, post, comb = hc_pre(h, w.ffn_hc, cfg)
        out = moe_block(rms_norm(x, w.ffn_norm, cfg.rms_norm_eps), inputs.tokens, w.moe, cfg)
        h = hc_post(out, h, post, comb)
    return h, cache


def hidden_states(weights: Weights, cache: list[LayerCache], inputs: StepInputs, cfg: ModelConfig):
    """Final-normed hidden states [b, t, d] and the updated cache."""
    x = weights.embed[inputs.tokens]
    h = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], cfg.hc_mult, x.shape[-1]))
    new_cache = []
    for i, (w, c) in enumerate(zip(weights.layers, cache)):
        with jax.named_scope(f"layer_{i}"):
            h, c = block(h, w, c, inputs, cfg, i)
        new_cache.append(c)
    y = hc_head(h, weights.hc_head_fn, weights.hc_head_base, weights.hc_head_scale, cfg)
    return rms_norm(y, weights.norm, cfg.rms_norm_eps), new_cache


def logits_all(weights: Weights, cache: list[LayerCache], inputs: StepInputs, cfg: ModelConfig):
    """Logits at every position [b, t, V] (float32)."""
    y, cache = hidden_states(weights, cache, inputs, cfg)
    return jnp.einsum("btd,dv->btv", y, weights.head, preferred_element_type=F32), cache


def logits_last(weights: Weights, cache: list[LayerCache], inputs: StepInputs, cfg: ModelConfig):
    """Logits at each row's last valid token [b, V] (float32): what sampling needs."""
    y, cache = hidden_states(weights, cache, inputs, cfg)
    last = jnp.clip(inputs.lengths - 1, 0, None)
    y_last = jnp.take_along_axis(y, last[:, None, None], axis=1)[:, 0]
    return jnp.einsum("bd,dv->bv", y_last, weights.head, preferred_element_type=F32), cache
