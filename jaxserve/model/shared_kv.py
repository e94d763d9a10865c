"""DeepSeek-V4.1's attention for one layer over a chunk (CSA2): a low-rank query (no per-head norm), K=V single head
rounded to FP8 as trained, the sliding window in every layer, and in a compressed layer the top-k entries of the
compressed KV its group shares, attention sinks, inverse RoPE on the output, the grouped output projection.

Only a group's KV source compresses: its entries (FP4-rounded, rotated) and indexer keys (from the same unrotated
latents, FP4-rounded) go into its own paged pools, which the later layers of its group read (`Shared.source`). An index
source scores those keys and picks the top-k entries each query attends to (`Shared.picks`), which the layers after it
reuse; the candidate source's best blocks bound every later index source's picks (`Shared.candidates`, the two-level
top-k). What one layer hands the next travels in `Shared`, per group of rows.

Letters: b rows, t chunk time, h heads, k head dim, r q-lora rank, e compressed entries of a row, c indexer head
dim, j picks, n candidate blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import CSA, SWA, ModelConfig
from jaxserve.kernels.indexer import indexer_scores, top_visible
from jaxserve.kernels.norm import rms_norm
from jaxserve.kernels.qat import FP4_ENTRY_BLOCK, FP4_INDEX_BLOCK, fake_fp4, fake_fp8
from jaxserve.kernels.rope import apply_rope
from jaxserve.kernels.table import Kernels
from jaxserve.model.attention import (
    compress_rows,
    output_projection,
    read_entries,
    read_picked_entries,
    window_keys,
    write_entries,
    write_window,
    writing_slots,
)
from jaxserve.model.cache import LayerCache
from jaxserve.model.compressor import NewEntries
from jaxserve.model.inputs import StepInputs
from jaxserve.model.layers import rope_frequencies
from jaxserve.model.segments import LayerKind
from jaxserve.model.weights import Attention, Compressor, Indexer

F32 = jnp.float32


@dataclass
class Source:
    """A KV source's pools (stacked [layers, pages, per_page, ...]) and its place in their stack."""

    entries: Any
    index_entries: Any
    layer: jax.Array


@dataclass
class Picks:
    """The entries each query attends to: indices into its row's entries [b, t, j] and which are real picks."""

    index: jax.Array
    valid: jax.Array


@dataclass
class Shared:
    """What a layer reads from the layers before it in this forward: its group's KV source (the same for every group
    of rows: set once the source layer has run for all of them) and, per group, the picks and candidate blocks."""

    source: Source | None = None
    picks: list[Picks | None] = dataclasses.field(default_factory=list)
    candidates: list[jax.Array | None] = dataclasses.field(default_factory=list)


def shared_kv_attention(
    x: jax.Array,
    w: Attention,
    cache: LayerCache,
    layer: jax.Array,
    inputs: StepInputs,
    cfg: ModelConfig,
    kind: LayerKind,
    kernels: Kernels,
    shared: Shared,
    group: int,
) -> tuple[jax.Array, LayerCache]:
    """One DeepSeek-V4.1 layer's attention over a group of rows; `cache` is its stack's, `layer` its place there.
    Updates `shared` (the group's picks and candidates); returns the output and the cache."""
    freqs = rope_frequencies(cfg, CSA if kind.rate else SWA)
    qpos = inputs.query_positions
    eps = cfg.rms_norm_eps

    with jax.named_scope("query"):
        q_norm = dict(norm=w.q_norm, norm_eps=eps)
        qr = kernels.einsum("btd,dr->btr", x, w.wq_a)
        q = apply_rope(kernels.einsum("btr,rhk->bthk", qr, w.wq_b, **q_norm), qpos[:, :, None], freqs)

    with jax.named_scope("kv"):
        kv = rms_norm(kernels.einsum("btd,dk->btk", x, w.wkv), w.kv_norm, eps)
        kv = fake_fp8(apply_rope(kv, qpos, freqs))

    with jax.named_scope("window_keys"):
        keys, keys_mask, ring_rows = window_keys(kv, cache, layer, inputs, cfg.sliding_window)

    selected = selected_mask = None
    if kind.rate:
        source = shared.source
        if kind.kv_source:  # its own pools, as this group of rows leaves them
            with jax.named_scope("compressor"):
                cache = _compress(x, w, cache, layer, inputs, cfg, kind, freqs)
                source = Source(cache.entries, cache.index_entries, layer)
        assert source is not None  # every compressed layer has a KV source at or before it (SharedKVConfig)
        if kind.index_source:
            with jax.named_scope("indexer"):
                assert w.indexer is not None  # every index source's weights carry an indexer
                q_index = kernels.einsum("btr,rhc->bthc", qr, w.indexer.wq_b, **q_norm)
                shared.picks[group] = _pick(x, q_index, w.indexer, source, inputs, cfg, kind, shared, group, freqs)
        picks = shared.picks[group]
        assert picks is not None  # an index source at or before this layer in the same pass (segments)
        with jax.named_scope("read_picks"):
            selected = read_picked_entries(source.entries, source.layer, inputs.page_table, picks.index, kv.dtype)
            selected_mask = picks.valid

    with jax.named_scope("attend"):
        o = kernels.sink_attention(q, keys, keys_mask, w.sinks, selected, selected_mask)
        o = apply_rope(o, qpos[:, :, None], freqs, inverse=True)

    with jax.named_scope("output_projection"):
        out = output_projection(o, w, cfg, kernels)

    with jax.named_scope("window_write"):
        cache = write_window(cache, layer, ring_rows, kv, inputs)
    return out, cache


def _compress(x, w: Attention, cache: LayerCache, layer, inputs: StepInputs, cfg: ModelConfig, kind, freqs):
    """A KV source's compressor over the chunk: the groups it completes become entries (rotated, FP4-rounded) and
    indexer keys (k_norm(latent @ wk), rotated, FP4-rounded), written into the source's pools."""
    comp, idx = w.compressor, w.indexer
    assert comp is not None and idx is not None and idx.wk is not None  # a KV source owns both
    if kind.rate > 1:
        new, state = compress_rows(
            x,
            comp,
            cache.state,
            layer,
            inputs,
            writing_slots(inputs, cache.window.shape[1]),
            kind.rate,
            freqs,
            cfg,
            rotate=False,
        )
        cache = dataclasses.replace(cache, state=state)
    else:  # every token its own entry: nothing pooled, no partial group to carry
        new = NewEntries(_ratio_one(x, comp, cfg), inputs.query_positions, inputs.token_mask)
    positions = new.index * kind.rate  # an entry sits at its group's first token
    index_keys = rms_norm(jnp.einsum("bwk,kc->bwc", new.values, idx.wk.astype(F32)), idx.k_norm, cfg.rms_norm_eps)
    index_keys = fake_fp4(apply_rope(index_keys, positions, freqs), FP4_INDEX_BLOCK)
    entries = fake_fp4(apply_rope(new.values, positions, freqs), FP4_ENTRY_BLOCK, e4m3_scales=True)
    return dataclasses.replace(
        cache,
        entries=write_entries(cache.entries, layer, dataclasses.replace(new, values=entries), inputs.page_table),
        index_entries=write_entries(
            cache.index_entries, layer, dataclasses.replace(new, values=index_keys), inputs.page_table
        ),
    )


def _ratio_one(x: jax.Array, comp: Compressor, cfg: ModelConfig) -> jax.Array:
    """A ratio-1 source's latents [b, t, k]: its normed projection of every token."""
    return rms_norm(jnp.einsum("btd,dk->btk", x.astype(F32), comp.wkv.astype(F32)), comp.norm, cfg.rms_norm_eps)


def _pick(
    x,
    q,
    idx: Indexer,
    source: Source,
    inputs: StepInputs,
    cfg: ModelConfig,
    kind: LayerKind,
    shared: Shared,
    group: int,
    freqs,
) -> Picks:
    """An index source's top-k: its queries `q` [b, t, h, c] (rotated and FP4-rounded here) score the source's
    indexer keys; an entry is visible once the query passed its group's last token; the candidate source's best
    blocks bound a later index source's choice, and the candidate source makes them."""
    qpos = inputs.query_positions
    q = fake_fp4(apply_rope(q, qpos[:, :, None], freqs), FP4_INDEX_BLOCK)
    head_weights = jnp.einsum("btd,dh->bth", x.astype(F32), idx.weights_proj.astype(F32)) * cfg.index_n_heads**-0.5
    keys = read_entries(source.index_entries, source.layer, inputs.page_table, F32)  # [b, e, c]
    visible_count = (qpos + 1) // kind.rate  # [b, t]
    visible = jnp.arange(keys.shape[1])[None, None, :] < visible_count[:, :, None]
    scores = indexer_scores(q, head_weights, keys)
    if kind.candidates == "source":
        shared.candidates[group] = _candidate_blocks(jnp.where(visible, scores, -jnp.inf), visible_count, cfg)
    elif kind.candidates == "uses":
        candidates = shared.candidates[group]
        assert candidates is not None  # the candidate source ran before this layer in this forward
        visible = visible & candidates
    return Picks(*top_visible(scores, visible, min(cfg.index_topk, keys.shape[1])))


def _candidate_blocks(scores: jax.Array, visible_count: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The two-level top-k's first level [b, t, e] bool: each query's best `candidate_topk_blocks` blocks of
    `candidate_block_size` entries (a block scores its best entry; the block holding the newest visible entry is
    always kept, as it is still filling)."""
    kv = cfg.shared_kv
    assert kv is not None
    size = kv.candidate_block_size
    b, t, e = scores.shape
    n = -(-e // size)
    blocks = jnp.pad(scores, ((0, 0), (0, 0), (0, n * size - e)), constant_values=-jnp.inf)
    blocks = jnp.max(blocks.reshape(b, t, n, size), axis=-1)  # [b, t, n]
    newest = (visible_count - 1) // size  # -1 (no block) before the first entry
    blocks = jnp.where(jnp.arange(n)[None, None, :] == newest[:, :, None], jnp.inf, blocks)
    top, index = jax.lax.top_k(blocks, min(kv.candidate_topk_blocks, n))
    rows, queries = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
    kept = jnp.zeros((b, t, n), bool).at[rows, queries, index].max(top > -jnp.inf)
    return jnp.repeat(kept, size, axis=-1)[..., :e]
