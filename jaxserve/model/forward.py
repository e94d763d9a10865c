"""The whole DeepSeek-V4 forward over a chunk per row: embed into hc streams, blocks, hc_head, norm, head.

Pure: (weights, cache, inputs) -> (outputs, cache). Decode is a chunk of length 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from jaxserve.config import ModelConfig
from jaxserve.kernels.norm import rms_norm
from jaxserve.kernels.quant import LayerOf, Quantized, one_layer
from jaxserve.kernels.table import REFERENCE_KERNELS, Kernels
from jaxserve.model.attention import attention_block
from jaxserve.model.cache import LayerCache
from jaxserve.model.engram import engram_layout, engram_mix, hash_ids, lookup
from jaxserve.model.inputs import StepInputs
from jaxserve.model.layers import collapse, hc_post, hc_pre, hc_site
from jaxserve.model.moe import moe_block
from jaxserve.model.segments import LayerKind, Segment, layer_segments
from jaxserve.model.shared_kv import Shared, Source, shared_kv_attention
from jaxserve.model.weights import (
    ALWAYS_IN_PLACE,
    BLOCK_NORMS,
    MTP_KIND,
    ONE_DEVICE_IN_PLACE,
    Engram,
    HyperConnection,
    Layer,
    MTPBlock,
    RoutedExperts,
    Weights,
    is_quantized,
)

F32 = jnp.float32


def block(
    hs: list[jax.Array],
    w: Layer,
    experts: RoutedExperts,
    cache: LayerCache,
    layer: jax.Array,
    groups: Sequence[StepInputs],
    cfg: ModelConfig,
    kind: str,
    kernels: Kernels,
    draft_block: bool = False,
):
    """One decoder block over every group of rows. Groups differ in chunk length (e.g. prefill rows beside
    one-token decode rows); attention runs per group, the MoE over all their tokens at once. `w` is this layer's
    weights but its routed experts, which `experts` holds for every layer of the stack (`layer` picks).
    `draft_block`: a DSpark drafter's block (attention_block's draft_block)."""
    with jax.named_scope("attention"):
        mixed = []
        for h, inputs in zip(hs, groups):
            normed, post, comb = kernels.rows(lambda h: hc_pre(h, w.attn_hc, cfg, kernels, w.attn_norm), h, lead=2)
            out, cache = attention_block(normed, w.attn, cache, layer, inputs, cfg, kind, kernels, draft_block)
            mixed.append(kernels.rows(hc_post, out, h, post, comb, lead=2))
        hs = mixed
    with jax.named_scope("moe"):
        sites = [kernels.rows(lambda h: hc_pre(h, w.ffn_hc, cfg, kernels, w.ffn_norm), h, lead=2) for h in hs]
        hs = _moe(hs, [normed for normed, _, _ in sites], sites, w, experts, layer, groups, cfg, kernels)
    return hs, cache


def _moe(hs, xs, sites, w: Layer, experts: RoutedExperts, layer, groups: Sequence[StepInputs], cfg, kernels):
    """The MoE over every group's tokens at once (`xs`: each group's collapsed, normed input), its output put back
    into each group's streams `hs` with the site's post weights and comb matrix (`sites`: (_, post, comb) a group)."""
    flat = jnp.concatenate([x.reshape(1, -1, x.shape[-1]) for x in xs], axis=1)
    tokens = jnp.concatenate([g.tokens.reshape(1, -1) for g in groups], axis=1)
    out = kernels.rows(lambda x, t: moe_block(x, t, w.moe, experts, layer, cfg, kernels), flat, tokens, lead=2)[0]
    sizes = np.cumsum([g.tokens.size for g in groups])[:-1]
    return [
        kernels.rows(hc_post, o.reshape(h.shape[0], h.shape[1], -1), h, post, comb, lead=2)
        for o, h, (_, post, comb) in zip(jnp.split(out, sizes), hs, sites)
    ]


def shared_kv_block(
    hs: list[jax.Array],
    pres: list[jax.Array],
    w: Layer,
    experts: RoutedExperts,
    cache: LayerCache,
    layer: jax.Array,
    groups: Sequence[StepInputs],
    cfg: ModelConfig,
    kind: LayerKind,
    kernels: Kernels,
    shared: Shared,
    ngram_ids: list[jax.Array] | None,
):
    """One DeepSeek-V4.1 block over every group of rows: its Engram (if any) writes into the streams, then attention
    and the MoE, each site collapsing the streams with the `pre` weights of the site before it (`pres`, per group: the
    first site's collapse takes stream 0) and computing its own for the next. Returns the streams, the last site's
    `pre` and the cache."""
    if w.engram is not None:
        assert ngram_ids is not None  # an Engram model's forward hashes every group's n-grams
        with jax.named_scope("engram"):
            hs = [
                engram_streams(h, ids[:, :, kind.engram], w.engram, g.token_mask, cfg, kernels)
                for h, ids, g in zip(hs, ngram_ids, groups)
            ]
    with jax.named_scope("attention"):
        mixed, attn_pres = [], []
        for g, (h, pre, inputs) in enumerate(zip(hs, pres, groups)):
            attn_pre, post, comb = hc_site(h, w.attn_hc, cfg)
            x = collapse(h, pre, w.attn_norm, cfg)
            out, cache = shared_kv_attention(x, w.attn, cache, layer, inputs, cfg, kind, kernels, shared, g)
            mixed.append(hc_post(out, h, post, comb))
            attn_pres.append(attn_pre)
        if kind.kv_source:  # the group's later layers read the pools every group of rows has written
            shared.source = Source(cache.entries, cache.index_entries, layer)
        hs = mixed
    with jax.named_scope("moe"):
        sites = [hc_site(h, w.ffn_hc, cfg) for h in hs]
        xs = [collapse(h, pre, w.ffn_norm, cfg) for h, pre in zip(hs, attn_pres)]
        hs = _moe(hs, xs, sites, w, experts, layer, groups, cfg, kernels)
    return hs, [pre for pre, _, _ in sites], cache


def engram_streams(
    h: jax.Array, ids: jax.Array, w: Engram, token_mask: jax.Array, cfg: ModelConfig, kernels: Kernels
) -> jax.Array:
    """The streams [b, t, n, d] with the Engram's gated value added: its table's rows `ids` [b, t, c] gathered (only
    those rows are read and decoded), projected to a key per stream and a shared value."""
    b, t = ids.shape[:2]
    rows = engram_rows(w.table, ids, cfg.engram_on_host)
    kv = kernels.einsum("btx,xn->btn", rows.reshape(b, t, -1).astype(h.dtype), w.wkv)
    return engram_mix(h, kv, one_layer(w.q_weight), one_layer(w.k_weight), cfg.rms_norm_eps, token_mask)


def engram_rows(table: Any, ids: jax.Array, on_host: bool) -> jax.Array:
    """An Engram table's rows `ids` [..., c] decoded to float32 [..., c, k]; gathered in the host's memory, and only
    those rows copied to the device, where the table lives there (`on_host`)."""
    stacked = isinstance(table, LayerOf)
    if stacked:  # read in place from the stack as one run of rows (sliced, it would be copied)
        ids = ids + table.layer * jax.tree.leaves(table.stack)[0].shape[1]
        table = table.stack

    def gather(ids):
        # Reshaped where the table lives (in host memory: inside the host computation).
        rows = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), table) if stacked else table
        return jax.tree.map(lambda a: a[ids], rows)

    def decoded(rows) -> jax.Array:
        return lookup(rows.codes, rows.scales) if isinstance(rows, Quantized) else rows.astype(F32)

    if not on_host:
        return decoded(gather(ids))
    with jax.named_scope("engram_host_gather"):
        ids = jax.device_put(ids, jax.memory.Space.Host)
        with compute_on("device_host"):
            rows = gather(ids)
        # The rows cross the host link as stored (FP8 codes and their scales: 264 B a release row, not 1 KB
        # decoded) and are decoded on the device.
        return decoded(jax.device_put(rows, jax.memory.Space.Device))


def run_segment(
    hs: list[jax.Array],
    weights: list[Layer],
    cache: list[LayerCache],
    segment: Segment,
    groups: Sequence[StepInputs],
    cfg: ModelConfig,
    kernels: Kernels,
    taps: list[jax.Array] | None = None,
    pres: list[jax.Array] | None = None,
    shared: Shared | None = None,
    ngram_ids: list[jax.Array] | None = None,
):
    """A segment's layers: one traced body per position of its pattern, scanned over the repeats. A repeat's weights are
    its slices of the stacks, but for the routed experts, which each layer reads in place by its index (sliced, every
    layer's experts would be copied every step: most of a decode step's bytes), the hyper-connections and, on one
    device, the quantized projections, which reach their kernels as `LayerOf` views (a Pallas kernel reads the layer in
    place; sliced, each would be copied every step, a launch each). Under a mesh that splits weights, a kernel call
    outside shard_map gets its operands gathered whole, so the projections are sliced there (the hyper-connections'
    weights are replicated on every mesh). The stacked cache rides in
    the carry and each layer updates its own slice in place (slicing it out and back would copy the whole KV cache every
    step).

    `taps`: per group, the streams averaged over the hc axis after each tapped layer ([taps + 1, b, t, d]: slot
    `tap_slots(cfg)[layer]`, the last one a sink for the layers not tapped), updated and returned beside the cache.

    DeepSeek-V4.1 (`cfg.v41`): `pres`, per group, the collapse weights of the site before (carried, returned),
    `shared` what a layer reads from the layers before it (jaxserve.model.shared_kv: inside a scanned body its picks
    stay in the body; after the segment its last KV source's pools are the group's), `ngram_ids` the Engram's row
    ids per group."""
    stacks, experts = zip(*(RoutedExperts.split(w) for w in weights))
    mesh = jax.sharding.get_abstract_mesh()
    in_place = mesh.empty or mesh.size == 1

    def read_in_place(a) -> bool:
        return is_quantized(a) or isinstance(a, HyperConnection)

    def kept_whole(path, a) -> bool:
        # A hyper-connection's weights and the block norms are replicated on every mesh (read whole, no gather).
        name = getattr(path[-1], "name", None)
        in_place_here = is_quantized(a) or name in ONE_DEVICE_IN_PLACE
        return (
            isinstance(a, HyperConnection)
            or name in BLOCK_NORMS
            or name in ALWAYS_IN_PLACE
            or (in_place and in_place_here)
        )

    # Per position: its weights as leaves (a Quantized is one, a HyperConnection too), whether each is kept whole,
    # those the scan slices (the rest left None) and the structure to put a repeat's layer back together.
    flat = []
    for stack in stacks:
        with_paths, tree = jax.tree_util.tree_flatten_with_path(stack, is_leaf=read_in_place)
        flat.append(([a for _, a in with_paths], [kept_whole(p, a) for p, a in with_paths], tree))
    sliced = [[None if whole else a for a, whole in zip(leaves, wholes)] for leaves, wholes, _ in flat]

    slots = None if taps is None else tap_slots(cfg)

    scanned = not ((kernels.unrolled_layers and in_place) or segment.repeats == 1)

    def one_repeat(carry, xs):
        hs, cache, taps, pres = carry
        layers, index = xs
        cache = list(cache)
        here = shared
        # A scanned body's picks, candidates and pools live in the body only (what a later segment reads is made
        # before it, segments.layer_segments): traced once, it works on a copy.
        if scanned and here is not None:
            here = dataclasses.replace(here, picks=list(here.picks), candidates=list(here.candidates))
        for p, (kind, (leaves, wholes, tree), slices) in enumerate(zip(segment.pattern, flat, layers)):
            kept = [LayerOf(a, index) if whole else s for a, whole, s in zip(leaves, wholes, slices)]
            w = jax.tree.unflatten(tree, kept)
            with jax.named_scope(f"{kind.attention}_hash" if kind.hashed else kind.attention):
                if cfg.v41:
                    assert here is not None and pres is not None  # hidden_states makes both for V4.1
                    hs, pres, cache[p] = shared_kv_block(
                        hs, pres, w, experts[p], cache[p], index, groups, cfg, kind, kernels, here, ngram_ids
                    )
                else:
                    hs, cache[p] = block(hs, w, experts[p], cache[p], index, groups, cfg, kind.attention, kernels)
            if taps is not None and slots is not None:
                slot = slots[segment.start + index * len(segment.pattern) + p]
                taps = [tap.at[slot].set(jnp.mean(h.astype(F32), axis=-2).astype(h.dtype)) for tap, h in zip(taps, hs)]
        return (hs, cache, taps, pres), None

    # A single repeat is inlined rather than looped; so is every repeat where the kernel table says so, on one device
    # (under a mesh that splits the weights, Flash at TP 8 unrolled compiled 5x slower, 23 min for its 14 step shapes
    # on 2 cores, and its steps' temporaries grew by up to 2.5 GB a device). Inlined, each repeat's layer index is a
    # constant: as an element of an index array (a scan's, even unrolled) XLA computes it with a kernel of its own
    # for every layer whose kernels take it as an operand.
    carry = (hs, list(cache), taps, pres)
    if not scanned:
        for index in range(segment.repeats):
            carry, _ = one_repeat(carry, (jax.tree.map(lambda a, i=index: a[i], sliced), jnp.int32(index)))
    else:
        carry, _ = jax.lax.scan(one_repeat, carry, (sliced, jnp.arange(segment.repeats, dtype=jnp.int32)))
        sources = [p for p, kind in enumerate(segment.pattern) if kind.kv_source]
        if shared is not None and sources:  # the last repeat's last KV source is the one the next layers read
            last = carry[1][sources[-1]]
            shared.source = Source(last.entries, last.index_entries, jnp.int32(segment.repeats - 1))
    hs, cache, taps, pres = carry
    return hs, cache, taps, pres


def tap_slots(cfg: ModelConfig) -> jax.Array:
    """Per layer, where the DSpark drafter's taps keep its output: the place of the layer among the tapped ones in
    ascending order (the order the drafter concatenates them), or one past them for a layer not tapped."""
    tapped = sorted(cfg.dspark.target_layer_ids) if cfg.dspark is not None else []
    return jnp.asarray([tapped.index(i) if i in tapped else len(tapped) for i in range(cfg.num_layers)], jnp.int32)


def hidden_states(
    weights: Weights,
    cache: list[list[LayerCache]],
    groups: Sequence[StepInputs],
    cfg: ModelConfig,
    kernels: Kernels = REFERENCE_KERNELS,
):
    """Final-normed hidden states ([b, t, d] per group) and the updated cache; `kernels` (jaxserve.kernels.table)
    runs the kernel-worthy operations."""
    hs, new_cache, _, pres = tapped_streams(weights, cache, groups, cfg, kernels, tap=False)
    return [
        output_states(weights, h, None if pres is None else pres[i], cfg, kernels) for i, h in enumerate(hs)
    ], new_cache


def output_states(
    weights: Weights, h: jax.Array, pre: jax.Array | None, cfg: ModelConfig, kernels: Kernels = REFERENCE_KERNELS
) -> jax.Array:
    """What the LM head reads [b, t, d] from the last block's streams `h`: collapsed by the HC head and normed, or in
    DeepSeek-V4.1 (no HC head) collapsed with the last site's weights `pre` and normed."""
    if cfg.v41:
        assert pre is not None  # tapped_streams returns them for V4.1
        return collapse(h, pre, weights.norm, cfg)
    return kernels.rows(
        lambda h: final_norm(
            h, weights.hc_head_fn, weights.hc_head_base, weights.hc_head_scale, weights.norm, cfg, kernels
        ),
        h,
        lead=2,
    )


def final_norm(
    h: jax.Array, fn: Any, base: Any, scale: Any, norm: Any, cfg: ModelConfig, kernels: Kernels = REFERENCE_KERNELS
):
    """The hc streams [b, t, n, d] collapsed by an HC head and normed: what the LM head reads [b, t, d]."""
    with jax.named_scope("hc_head"):
        return kernels.hc_head(h, fn, base, scale, norm, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)


def hidden_streams(
    weights: Weights,
    cache: list[list[LayerCache]],
    groups: Sequence[StepInputs],
    cfg: ModelConfig,
    kernels: Kernels = REFERENCE_KERNELS,
):
    """The last block's hc streams ([b, t, n, d] per group: what the HC head and an MTP block read) and the updated
    cache."""
    hs, new_cache, _, _ = tapped_streams(weights, cache, groups, cfg, kernels, tap=False)
    return hs, new_cache


def tapped_streams(
    weights: Weights,
    cache: list[list[LayerCache]],
    groups: Sequence[StepInputs],
    cfg: ModelConfig,
    kernels: Kernels = REFERENCE_KERNELS,
    tap: bool = True,
):
    """hidden_streams, and with `tap` the DSpark drafter's input per group: the streams after each of its target
    layers averaged over the hc axis, concatenated in ascending layer order ([b, t, taps * d]; None without `tap`);
    and for DeepSeek-V4.1 the last site's collapse weights per group (None otherwise)."""
    hs = []
    for inputs in groups:
        x = weights.embed[inputs.tokens]
        hs.append(jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], cfg.hc_mult, x.shape[-1])))
    n_taps = len(cfg.dspark.target_layer_ids) if tap and cfg.dspark is not None else 0
    taps = [jnp.zeros((n_taps + 1, *h.shape[:2], h.shape[-1]), h.dtype) for h in hs] if n_taps else None
    pres = shared = ngram_ids = None
    if cfg.v41:  # the first site collapses stream 0 alone
        pres = [jnp.zeros(h.shape[:-1], F32).at[..., 0].set(1.0) for h in hs]
        shared = Shared(picks=[None] * len(groups), candidates=[None] * len(groups))
        if cfg.engram is not None:
            ngram_ids = [ngram_hashes(g, weights.ngram_products, cfg) for g in groups]
    new_cache = []
    for i, (segment, w, c) in enumerate(zip(layer_segments(cfg), weights.segments, cache)):
        with jax.named_scope(f"segment_{i}"):
            hs, c, taps, pres = run_segment(hs, w, c, segment, groups, cfg, kernels, taps, pres, shared, ngram_ids)
        new_cache.append(c)
    if taps is None:
        return hs, new_cache, None, pres
    features = [jnp.concatenate(list(tap[:n_taps]), axis=-1) for tap in taps]
    return hs, new_cache, features, pres


def ngram_hashes(inputs: StepInputs, products: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The Engram row ids of a group's tokens [b, t, Engram layers, columns], from the tokens before its rows'
    first (`inputs.context`) and its own."""
    assert inputs.context is not None and cfg.engram is not None  # an Engram model's inputs carry the context
    engram = cfg.engram
    with jax.named_scope("ngram_hashes"):
        context = inputs.context[:, inputs.context.shape[1] - (engram.max_ngram - 1) :]
        # A padding position's token is kept out of the n-grams (it is never read: its rows are masked).
        tokens = jnp.where(inputs.token_mask, inputs.tokens, 0)
        return hash_ids(context, tokens, products, engram_layout(engram))


def mtp_block(
    w: MTPBlock,
    embed: jax.Array,
    streams: jax.Array,
    cache: LayerCache,
    inputs: StepInputs,
    cfg: ModelConfig,
    kernels: Kernels = REFERENCE_KERNELS,
):
    """An MTP block over a chunk: `streams` [b, t, n, d] are the main model's last hc streams at positions
    p..p+t-1 (or this block's own output, to draft further), `inputs.tokens` the tokens at p+1..p+t. Returns its
    output streams, its final-normed hidden states [b, t, d] (the head's input: guesses at the tokens at p+2..),
    and its cache (one sliding-window layer, stacked as one repeat)."""
    with jax.named_scope("mtp"):
        e = rms_norm(embed[inputs.tokens], w.enorm, cfg.rms_norm_eps)
        h = rms_norm(streams, w.hnorm, cfg.rms_norm_eps)
        b, t, n, d = h.shape
        # The streams' projection as the matmul the other projections run (one [b, t*n, d] activation).
        projected = kernels.einsum("btd,dr->btr", h.reshape(b, t * n, d), w.h_proj).reshape(b, t, n, -1)
        x = kernels.einsum("btd,dr->btr", e, w.e_proj)[:, :, None, :] + projected
        layer, experts = RoutedExperts.split(w.block)
        first = jnp.zeros((), jnp.int32)
        (out,), cache = block(
            [x.astype(streams.dtype)],
            jax.tree.map(lambda a: a[0], layer),
            experts,
            cache,
            first,
            [inputs],
            cfg,
            MTP_KIND.attention,
            kernels,
        )
        y = final_norm(out, w.hc_head_fn, w.hc_head_base, w.hc_head_scale, w.norm, cfg, kernels)
    return out, y, cache


def logits_all(
    weights: Weights,
    cache: list[list[LayerCache]],
    inputs: StepInputs,
    cfg: ModelConfig,
    kernels: Kernels = REFERENCE_KERNELS,
):
    """Logits at every position [b, t, V] (float32)."""
    (y,), cache = hidden_states(weights, cache, [inputs], cfg, kernels)
    return vocab_logits(y, weights.head, cfg.vocab_size), cache


def vocab_logits(y: jax.Array, head: jax.Array, vocab_size: int) -> jax.Array:
    """Hidden states [..., d] times the head [d, padded V] -> logits [..., vocab_size] (float32): the head's padding
    columns (ModelConfig.padded_vocab_size) are cut off here, so no padded id reaches the sampler or the logprobs,
    and a softmax over these logits is one over the real vocabulary."""
    return jnp.einsum("...d,dv->...v", y, head, preferred_element_type=F32)[..., :vocab_size]


def last_logits(
    y: jax.Array, inputs: StepInputs, head: jax.Array, vocab_size: int, kernels: Kernels = REFERENCE_KERNELS
) -> jax.Array:
    """Logits at each row's last valid token ([b, V] float32) of one group's hidden states: what sampling needs."""
    last = jnp.clip(inputs.lengths - 1, 0, None)
    y_last = jnp.take_along_axis(y, last[:, None, None], axis=1)[:, 0]
    return kernels.rows(lambda y: vocab_logits(y, head, vocab_size), y_last)
