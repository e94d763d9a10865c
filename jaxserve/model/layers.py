"""Small building blocks: RoPE frequencies (plain, or YaRN-scaled for compressed layers) and the mHC collapse as the
block calls it (through the kernel table; the norms, rotations and hyper-connection maths themselves are the kernels'
references: jaxserve.kernels.norm, .rope, .mhc).

Letters: b batch rows, t query time, n hc streams, d embed, h heads, k head dim.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import SWA, ModelConfig
from jaxserve.kernels.mhc import hc_collapse, hc_weights
from jaxserve.kernels.quant import LayerOf
from jaxserve.kernels.table import Kernels
from jaxserve.model.weights import HyperConnection

F32 = jnp.float32


# ---- RoPE --------------------------------------------------------------------------------------------------------


def rope_frequencies(cfg: ModelConfig, kind: str) -> np.ndarray:
    """Per-pair angular frequencies [R/2]: plain theta on SWA layers, YaRN-scaled compress theta elsewhere."""
    r = cfg.rope_head_dim
    if kind == SWA:
        return 1.0 / cfg.rope_theta ** (np.arange(0, r, 2, dtype=np.float64) / r)
    base = cfg.compress_rope_theta
    freqs = 1.0 / base ** (np.arange(0, r, 2, dtype=np.float64) / r)
    yarn = cfg.yarn
    if yarn is None:
        return freqs

    def correction_dim(rotations: float) -> float:
        return r * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(yarn.beta_slow)), r - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(r // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return freqs * (1.0 - ramp) + freqs / yarn.factor * ramp


# ---- mHC -----------------------------------------------------------------------------------------------------------


def hc_pre(
    h: jax.Array, hc: HyperConnection | LayerOf, cfg: ModelConfig, kernels: Kernels, norm: Any = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Collapse the streams into one block input; return it with the post weights and the comb matrix. `hc` is one
    layer's weights, or a layer of the segment's stacked ones (kernels that can read it in place). `norm`: the
    block's input norm weight (a `LayerOf` view where `hc` is one): the block input comes out normalised by it."""
    fn, base, scale = _hc_parts(hc)
    with jax.named_scope("hc_pre"):
        return kernels.hc_pre(
            h, fn, base, scale, norm, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters
        )


def _hc_parts(hc: HyperConnection | LayerOf) -> tuple[Any, Any, Any]:
    """A hyper-connection's (fn, base, scale): one layer's, or `LayerOf` views of a stack's (kernels read them in
    place)."""
    if isinstance(hc, LayerOf):
        return LayerOf(hc.stack.fn, hc.layer), LayerOf(hc.stack.base, hc.layer), LayerOf(hc.stack.scale, hc.layer)
    return hc.fn, hc.base, hc.scale


def hc_post(out: jax.Array, h: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """Expand the block output into the streams and mix the residual: h'_k = post_k f + sum_j comb[j,k] h_j."""
    with jax.named_scope("hc_post"):
        dt = h.dtype
        expanded = post.astype(dt)[..., None] * out[..., None, :]
        # The n-term sum written out, in float32 and rounded once as a matmul would: elementwise work that XLA
        # fuses with the expansion and the add into one kernel (as an einsum it is a matmul kernel of its own).
        comb = comb.astype(dt).astype(F32)
        mixed = comb[..., 0, :, None] * h[..., 0, None, :].astype(F32)
        for j in range(1, h.shape[-2]):
            mixed += comb[..., j, :, None] * h[..., j, None, :].astype(F32)
    # The new streams are stored anyway (the next hc_pre reads them). Without the barrier XLA's GPU fusion may fuse
    # the previous layers' mixes into this one, each stream reading all of them: n^depth recomputation, and a decode
    # step of the tiny model took 54 s instead of 10 s to compile for an H200.
    return jax.lax.optimization_barrier(expanded + mixed.astype(dt))


def hc_site(h: jax.Array, hc: HyperConnection | LayerOf, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """DeepSeek-V4.1's single-pass mHC at one site: its (pre, post, comb) from the streams it receives; its `pre`
    collapses the streams at the next site (`collapse`)."""
    fn, base, scale = _hc_parts(hc)
    with jax.named_scope("hc_weights"):
        return hc_weights(h, fn, base, scale, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)


def collapse(h: jax.Array, pre: jax.Array, norm: Any, cfg: ModelConfig) -> jax.Array:
    """The streams [..., n, d] collapsed with the weights `pre` [..., n] and normed by `norm` (None: not normed)."""
    with jax.named_scope("hc_collapse"):
        return hc_collapse(h, pre, norm, cfg.rms_norm_eps)
