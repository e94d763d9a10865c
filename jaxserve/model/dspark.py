"""DeepSeek-V4 0731 / 0813's DSpark block drafter: the maths (jaxserve.runner.speculative drives it).

The target's hidden streams after each of its `target_layer_ids`, averaged over the hc axis and concatenated
(`forward.tapped_streams`), become one context feature a position: main_norm(main_proj(.)). Each of the drafter's
stages (a whole V4 decoder layer: mHC, sliding-window attention with sinks, MoE) keeps its own window ring of
context keys, made from those features by the stage's own wkv, kv_norm and RoPE at the context positions
(`write_context`); the stages never store keys of their own inputs.

A draft is one block (`draft_block`): the row's last sampled token at its position P (the anchor) and n - 1 copies of
the noise token after it, embedded into the hc streams and run through the stages in one parallel forward, every
block token seeing the whole block (not causal) and its stage's ring (the context's last W positions, all before P).
Block position i guesses the token at P + i + 1 from the LM head over the HC head's output, plus the Markov head's
logits of the token before it (the anchor for i = 0, then the previous draft), left to right: n drafts. Drafts are
each position's most likely token, as MTP's are (the verifier treats a draft as a point mass, so sampled rows still
draw from the target's distribution). The confidence head (adaptive verification) is not used.

Letters: b rows, t tokens, n drafts (the block), d hidden, r Markov rank, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import SWA, ModelConfig
from jaxserve.kernels.norm import rms_norm
from jaxserve.kernels.table import REFERENCE_KERNELS, Kernels
from jaxserve.model.attention import keys, write_window
from jaxserve.model.cache import LayerCache, gather
from jaxserve.model.forward import block, vocab_logits
from jaxserve.model.inputs import StepInputs
from jaxserve.model.layers import rope_frequencies
from jaxserve.model.weights import DSparkDrafter, RoutedExperts


def write_context(
    w: DSparkDrafter,
    rings: LayerCache,
    taps: jax.Array,
    inputs: StepInputs,
    cfg: ModelConfig,
    kernels: Kernels = REFERENCE_KERNELS,
) -> LayerCache:
    """The chunk's context keys into every stage's ring (`rings`: the stages' caches, stacked [S, ...]), from the
    target's taps [b, t, taps * d] at the chunk's positions; snapshot rows and a prefix-cache hit's source row as
    the target's own window ring takes them (attention.write_window)."""
    assert cfg.dspark is not None  # a drafter's weights come with its config
    with jax.named_scope("dspark_context"):
        x = rms_norm(kernels.einsum("btf,fd->btd", taps, w.main_proj), w.main_norm, cfg.rms_norm_eps)
        freqs = rope_frequencies(cfg, SWA)
        for stage in range(cfg.dspark.stages):
            attn = jax.tree.map(lambda a, i=stage: a[i], w.stages.attn)
            kv = keys(x, attn, inputs.query_positions, freqs, cfg, kernels)
            layer = jnp.asarray(stage, jnp.int32)
            rings = write_window(rings, layer, gather(rings.window, (layer, inputs.state_source)), kv, inputs)
    return rings


def draft_block(
    w: DSparkDrafter,
    embed: jax.Array,
    head: jax.Array,
    rings: LayerCache,
    anchors: jax.Array,
    inputs: StepInputs,
    n: int,
    cfg: ModelConfig,
    kernels: Kernels,
) -> jax.Array:
    """n drafts a row [b, n] from one block: `anchors` [b] are the rows' last sampled tokens, at `inputs.positions`
    (rows with length 0 are padding); the rings hold each row's context up to the position before."""
    assert cfg.dspark is not None  # a drafter's weights come with its config
    noise = jnp.full((anchors.shape[0], n - 1), cfg.dspark.noise_token_id, jnp.int32)
    tokens = jnp.concatenate([anchors[:, None].astype(jnp.int32), noise], axis=1)
    base = block_logits(w, embed, head, rings, tokens, inputs, cfg, kernels)

    def next_draft(previous: jax.Array, base_i: jax.Array) -> tuple[jax.Array, jax.Array]:
        draft = jnp.argmax(base_i + markov_logits(w, previous, cfg), axis=-1).astype(jnp.int32)
        return draft, draft

    with jax.named_scope("markov_head"):
        _, drafts = jax.lax.scan(next_draft, tokens[:, 0], jnp.moveaxis(base, 1, 0))
    return drafts.T


def block_logits(
    w: DSparkDrafter,
    embed: jax.Array,
    head: jax.Array,
    rings: LayerCache,
    tokens: jax.Array,
    inputs: StepInputs,
    cfg: ModelConfig,
    kernels: Kernels = REFERENCE_KERNELS,
) -> jax.Array:
    """The stages' logits [b, n, V] (float32) over blocks `tokens` [b, n] starting at `inputs.positions` (rows with
    length 0 are padding), before the Markov head's."""
    assert cfg.dspark is not None  # a drafter's weights come with its config
    b, n = tokens.shape
    with jax.named_scope("dspark_block"):
        block_inputs = StepInputs(
            tokens=tokens,
            positions=inputs.positions,
            lengths=jnp.where(inputs.lengths > 0, n, 0).astype(jnp.int32),
            slots=inputs.slots,
            page_table=inputs.page_table,
        )
        x = embed[tokens]
        h = jnp.broadcast_to(x[:, :, None, :], (b, n, cfg.hc_mult, x.shape[-1]))
        layers, experts = RoutedExperts.split(w.stages)

        def stage(h: jax.Array, xs) -> tuple[jax.Array, None]:
            """One stage (its layer's weights sliced by the scan; the routed experts read by its index)."""
            one, index = xs
            (h,), _ = block([h], one, experts, rings, index, [block_inputs], cfg, SWA, kernels, draft_block=True)
            return h, None

        # The stages as one scanned body: one layer compiled, not one per stage (on a GPU traced in line,
        # Kernels.unrolled_layers: three stages, little to compile, whatever the mesh).
        indices = jnp.arange(cfg.dspark.stages, dtype=jnp.int32)
        h, _ = jax.lax.scan(stage, h, (layers, indices), unroll=kernels.unrolled_layers)
        with jax.named_scope("hc_head"):
            y = kernels.hc_head(
                h, w.hc_head_fn, w.hc_head_base, w.hc_head_scale, w.norm, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps
            )
        return vocab_logits(y, head, cfg.vocab_size)


def markov_logits(w: DSparkDrafter, previous: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The Markov head's logits [..., V] (float32) of the tokens before the guessed ones."""
    return vocab_logits(w.markov_embed[previous], w.markov_out, cfg.vocab_size)
