"""DeepSeek-V4 attention for one layer over a chunk: low-rank query, K=V single head, sliding window in every
layer, plus dense HCA entries or indexer-selected CSA entries, attention sinks, inverse RoPE on the output,
grouped low-rank output projection. Reads and writes the layer's KV state in place: the cache arrays hold every
layer of a stack (leading `layers` axis), and `layer` picks this one, so a scan over the stack never copies it.
Stored K=V vectors and indexer keys go through jaxserve.model.cache's read_kv / write_kv, whatever their storage dtype.

Letters: b rows, t chunk time, h heads, k head dim, r q-lora rank, s keys, e compressed entries,
g output groups, j heads within a group, o o-lora rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import CSA, HCA, SWA, ModelConfig
from jaxserve.kernels.attention import QueryRotation
from jaxserve.kernels.norm import rms_norm
from jaxserve.kernels.quant import LayerOf, Quantized, dense, one_layer
from jaxserve.kernels.rope import apply_rope
from jaxserve.kernels.table import REFERENCE_KERNELS, Kernels
from jaxserve.model.cache import LayerCache, decode, encode, gather, read_kv, scatter, write_kv
from jaxserve.model.compressor import NewEntries, compress_chunk
from jaxserve.model.inputs import StepInputs
from jaxserve.model.layers import rope_frequencies
from jaxserve.model.weights import Attention

F32 = jnp.float32


def write_entries(pool, layer: jax.Array, new: NewEntries, page_table: jax.Array):
    """Scatter the completed entries into the paged pools [layers, pages, per_page, c] (any storage form) through
    the rows' page tables."""
    _, pages, per_page, _ = pool.shape
    page_slot = jnp.clip(new.index // per_page, 0, page_table.shape[1] - 1)
    page = jnp.where(new.valid, jnp.take_along_axis(page_table, page_slot, axis=1), pages)  # invalid -> dropped
    return write_kv(pool, (layer, page, new.index % per_page), new.values)


def read_entries(pool, layer: jax.Array, page_table: jax.Array, dtype) -> jax.Array:
    """A row's compressed entries in order, decoded to `dtype`: [b, max_pages * per_page, c]."""
    rows = read_kv(pool, (layer, page_table), dtype)  # [b, pages_per_seq, per_page, c]
    return rows.reshape(rows.shape[0], -1, rows.shape[-1])


def read_picked_entries(pool, layer: jax.Array, page_table: jax.Array, picks: jax.Array, dtype) -> jax.Array:
    """The compressed entries `picks [b, t, j]` (indices into a row's entries in order) name, gathered from the pool
    in their storage form and only then decoded to `dtype`: [b, t, j, c]. No other entry of the row is read."""
    per_page = pool.shape[2]
    pages = jnp.take_along_axis(page_table[:, None, :], picks // per_page, axis=2)  # [b, t, j]
    return read_kv(pool, (layer, pages, picks % per_page), dtype)


def compress_rows(
    x,
    comp_weights,
    state,
    layer,
    inputs: StepInputs,
    write_slots,
    rate,
    freqs,
    cfg,
    rotate: bool = True,
    kernels: Kernels = REFERENCE_KERNELS,
) -> tuple[NewEntries, Any]:
    """Run a compressor over the chunk; store its state (and the rows' snapshots of it); return its new entries
    (rotated to their positions unless `rotate` is False) and the updated state."""
    # The rows' states read once, materialised: XLA otherwise fuses the read into each consumer, some of which it
    # orders after the write below, and copies the whole stacked state (twice) to keep the old one for them.
    old = jax.lax.optimization_barrier(gather(state, (layer, inputs.state_source)))
    new, rows, snapshots = compress_chunk(
        x,
        comp_weights,
        old,
        inputs.positions,
        inputs.lengths,
        rate,
        freqs,
        cfg.rms_norm_eps,
        inputs.snapshot_lengths,
        rotate,
        kernels,
    )
    state = scatter(state, (layer, write_slots), rows)
    for j, snapshot in enumerate(snapshots):
        assert inputs.snapshot_rows is not None  # StepInputs sets it with snapshot_lengths
        state = scatter(state, (layer, inputs.snapshot_rows[:, j]), snapshot)
    return new, state


def _update_compressed(x, comp_weights, pool, state, layer, inputs: StepInputs, write_slots, rate, freqs, cfg, kernels):
    """Run a compressor over the chunk; store its new entries and state; return the updated pool and state."""
    new, state = compress_rows(x, comp_weights, state, layer, inputs, write_slots, rate, freqs, cfg, kernels=kernels)
    return write_entries(pool, layer, new, inputs.page_table), state


def attention_block(
    x: jax.Array,
    w: Attention,
    cache: LayerCache,
    layer: jax.Array,
    inputs: StepInputs,
    cfg: ModelConfig,
    kind: str,
    kernels: Kernels,
    draft_block: bool = False,
) -> tuple[jax.Array, LayerCache]:
    """One layer's attention; `cache` is its stack's, `layer` (int32 scalar) this layer's place in the stack.

    `draft_block` (a DSpark drafter's stage, sliding-window): every token of a row's block sees every other one (not
    causal) and the whole ring, the context's last W keys before the block (written by `write_context`, not here: the
    block's own keys are never stored)."""
    freqs = rope_frequencies(cfg, kind)
    b, t, _ = x.shape
    window = cfg.sliding_window
    num_slots = cache.window.shape[1]
    qpos = inputs.query_positions  # [b, t]
    write_slots = writing_slots(inputs, num_slots)

    with jax.named_scope("query"):
        # The low-rank query's norm is folded into both projections that read it (this one and the indexer's).
        q_norm = dict(norm=w.q_norm, norm_eps=cfg.rms_norm_eps)

        def query(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            qr = kernels.einsum("btd,dr->btr", x, w.wq_a)
            return qr, kernels.einsum("btr,rhk->bthk", qr, w.wq_b, **q_norm)  # normed per head, rotated in attention

        qr, q = kernels.rows(query, x, lead=2)

    with jax.named_scope("kv"):
        kv = kernels.rows(lambda x, p: keys(x, w, p, freqs, cfg, kernels), x, qpos, lead=2)

    with jax.named_scope("window_keys"):
        shared, shared_mask, ring_rows = window_keys(kv, cache, layer, inputs, window, draft_block)

    selected = selected_mask = None
    if kind != SWA:
        rate = cfg.kind_rate(kind)
        with jax.named_scope("compressor"):
            entries, state = _update_compressed(
                x, w.compressor, cache.entries, cache.state, layer, inputs, write_slots, rate, freqs, cfg, kernels
            )
            cache = dataclasses.replace(cache, entries=entries, state=state)
            row_capacity = inputs.page_table.shape[1] * entries.shape[2]  # entries a row's page table addresses
            entry_visible = jnp.arange(row_capacity)[None, None, :] < ((qpos + 1) // rate)[:, :, None]
        if kind == HCA:
            row_entries = read_entries(entries, layer, inputs.page_table, kv.dtype)  # [b, e, k]: all attended
            shared = jnp.concatenate([shared, row_entries], axis=1)
            shared_mask = jnp.concatenate([shared_mask, entry_visible], axis=2)
        else:
            assert kind == CSA
            with jax.named_scope("indexer"):
                idx = w.indexer
                assert idx is not None  # every CSA layer's weights carry an indexer
                index_entries, index_state = _update_compressed(
                    x,
                    idx.compressor,
                    cache.index_entries,
                    cache.index_state,
                    layer,
                    inputs,
                    write_slots,
                    rate,
                    freqs,
                    cfg,
                    kernels,
                )
                cache = dataclasses.replace(cache, index_entries=index_entries, index_state=index_state)
                index_keys = read_entries(index_entries, layer, inputs.page_table, kv.dtype)

                def index_query(qr: jax.Array, x: jax.Array, p: jax.Array) -> tuple[jax.Array, jax.Array]:
                    qi = apply_rope(kernels.einsum("btr,rhc->bthc", qr, idx.wq_b, **q_norm), p[:, :, None], freqs)
                    head_weights = jnp.einsum("btd,dh->bth", x.astype(F32), idx.weights_proj.astype(F32))
                    return qi, head_weights * cfg.index_n_heads**-0.5

                qi, head_weights = kernels.rows(index_query, qr, x, qpos, lead=2)
                k = min(cfg.index_topk, index_keys.shape[1])
                picks, selected_mask = per_query_topk(qi, head_weights, index_keys, entry_visible, k, kernels)
                # Only the picked entries are read and decoded (the indexer's keys are a separate, smaller store).
                selected = read_picked_entries(entries, layer, inputs.page_table, picks, kv.dtype)  # [b, t, k, dim]

    with jax.named_scope("attend"):
        rotation = QueryRotation(qpos, tuple(float(f) for f in freqs), cfg.rms_norm_eps)
        if kernels.row_tile is None:
            o = kernels.sink_attention(q, shared, shared_mask, w.sinks, selected, selected_mask, rotation)
        else:
            o = per_query_attention(
                q, shared, shared_mask, w.sinks, selected, selected_mask, rotation, inputs, window, kernels
            )

    with jax.named_scope("output_projection"):
        out = kernels.rows(lambda o: output_projection(o, w, cfg, kernels), o, lead=2)

    if not draft_block:
        with jax.named_scope("window_write"):
            cache = write_window(cache, layer, ring_rows, kv, inputs)
    return out, cache


def window_keys(
    kv: jax.Array, cache: LayerCache, layer: jax.Array, inputs: StepInputs, window: int, draft_block: bool = False
) -> tuple[jax.Array, jax.Array, Any]:
    """The keys every query of a row may see: its ring's last W K=V vectors then the chunk's own `kv` [b, t, k]
    ([b, W + t, k]), which of them each query sees ([b, t, W + t]: the last W positions up to its own; with
    `draft_block` the whole ring and block), and the rows' rings as stored (what `write_window` writes back)."""
    qpos, valid = inputs.query_positions, inputs.token_mask
    # Ring index j holds the latest position p < pos with p % W == j.
    last = inputs.positions[:, None] - 1
    ring_pos = last - jnp.mod(last - jnp.arange(window)[None, :], window)
    key_pos = jnp.concatenate([ring_pos, qpos], axis=1)  # [b, W + t]
    key_ok = jnp.concatenate([ring_pos >= 0, valid], axis=1)
    # The rows' rings [b, W, k], kept as stored: the write puts back what it read without re-encoding.
    ring_rows = gather(cache.window, (layer, inputs.state_source))
    # The chunk's own K=V as the ring will store them (a no-op when the cache stores the compute dtype): a token
    # sees every earlier one at the stored precision, wherever its chunk starts (so a prefix-cache hit, or any
    # other chunking, gives what one long chunk would).
    own = decode(encode(kv, ring_rows), kv.dtype)
    shared = jnp.concatenate([decode(ring_rows, kv.dtype), own], axis=1)
    rel = qpos[:, :, None] - key_pos[:, None, :]
    return shared, key_ok[:, None, :] & ((rel >= 0) & (rel < window) | draft_block), ring_rows


def per_query_topk(
    qi: jax.Array, head_weights: jax.Array, index_keys: jax.Array, visible: jax.Array, k: int, kernels: Kernels
) -> tuple[jax.Array, jax.Array]:
    """kernels.indexer_topk, and when batch-invariant (`kernels.row_tile`) one query at a time in fixed tiles of
    queries, each scoring its row's keys (`index_keys` [b, e, c]) by itself."""
    if kernels.row_tile is None:
        return kernels.indexer_topk(qi, head_weights, index_keys, visible, k)
    b, t = qi.shape[:2]

    def one(q, weights, keys, seen):  # a query [h, c], its head weights [h], its row's keys [e, c], its mask [e]
        picks, mask = kernels.indexer_topk(q[None, None], weights[None, None], keys[None], seen[None, None], k)
        return picks[0, 0], mask[0, 0]

    def tile(q, weights, seen, row):  # [1, tile, ...]
        picks, mask = jax.vmap(one)(q[0], weights[0], index_keys[row[0]], seen[0])
        return picks[None], mask[None]

    return kernels.rows(tile, qi, head_weights, visible, _row_of_each_query(b, t), lead=2)


def per_query_attention(
    q: jax.Array,
    shared: jax.Array,
    shared_mask: jax.Array,
    sinks: Any,
    selected: jax.Array | None,
    selected_mask: jax.Array | None,
    rotation: QueryRotation,
    inputs: StepInputs,
    window: int,
    kernels: Kernels,
) -> jax.Array:
    """kernels.sink_attention, batch-invariant: every query attends by itself, in fixed tiles of queries, to its
    keys in an order that does not depend on how its row was chunked: its window's last W positions oldest first
    (`window_order`), then its row's compressed entries (HCA) or its selected ones (CSA). `shared` is window_keys'
    ring and chunk [b, W + t, k], then any dense entries."""
    b, t = q.shape[:2]
    order, in_window = window_order(inputs, window)
    window_part = shared[:, : window + t]
    window_keys_of = jnp.take_along_axis(window_part[:, None], order[..., None], axis=2)  # [b, t, W, k]
    window_mask = jnp.take_along_axis(shared_mask[..., : window + t], order, axis=2) & in_window
    entries, entries_mask = shared[:, window + t :], shared_mask[..., window + t :]
    empty = jnp.zeros((1, 0, shared.shape[-1]), shared.dtype)

    def tile(q, keys, mask, more_mask, positions, row, picked=None, picked_mask=None):  # [1, tile, ...]
        extra = [entries[row[0]][None]] if entries.shape[1] else []  # the row's dense entries, for each query
        extra_mask = [more_mask] if entries.shape[1] else []
        if picked is not None:
            extra, extra_mask = extra + [picked], extra_mask + [picked_mask]
        all_keys = jnp.concatenate([keys, *extra], axis=2)
        all_mask = jnp.concatenate([mask, *extra_mask], axis=2)
        here = dataclasses.replace(rotation, positions=positions)
        return kernels.sink_attention(q, empty, jnp.zeros((1, q.shape[1], 0), bool), sinks, all_keys, all_mask, here)

    rows = _row_of_each_query(b, t)
    picked = () if selected is None else (selected, selected_mask)
    return kernels.rows(tile, q, window_keys_of, window_mask, entries_mask, rotation.positions, rows, *picked, lead=2)


def _row_of_each_query(b: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))


def window_order(inputs: StepInputs, window: int) -> tuple[jax.Array, jax.Array]:
    """Where each query's window keys sit in window_keys' [ring; chunk] keys, oldest first ([b, t, W]: the key at
    position qpos - W + 1 + i), and which of those positions exist (>= 0). The ring keeps position p at p % W
    (window_keys), the chunk its token at p - the chunk's first position."""
    qpos = inputs.query_positions
    key_pos = qpos[:, :, None] - (window - 1) + jnp.arange(window)[None, None, :]
    start = inputs.positions[:, None, None]
    index = jnp.where(key_pos >= start, window + key_pos - start, jnp.mod(key_pos, window))
    return index, key_pos >= 0


def output_projection(o: jax.Array, w: Attention, cfg: ModelConfig, kernels: Kernels) -> jax.Array:
    """The attention output [b, t, H, k] through wo_a's grouped projection and wo_b: [b, t, d]."""
    r = _grouped_output(o, w.wo_a, cfg, kernels)
    return kernels.einsum("btx,xd->btd", r, w.wo_b)


def _grouped_output(o: jax.Array, wo_a: Any, cfg: ModelConfig, kernels: Kernels) -> jax.Array:
    """wo_a's grouped projection [b, t, H, k] -> [b, t, g * o_lora]: each group of heads times its own matrix.
    Through `kernels.einsum` per group (vmapped), so an FP8 wo_a is decoded inside the matmul, never written out
    decoded; a group's matrix is wo_a's rows of its heads, [j * k, o_lora], whose scale blocks are whole K blocks
    when a block spans one head or whole heads (the release's layout: 1 x 128 x 128). Otherwise decoded whole."""
    b, t = o.shape[:2]
    g, j, k = cfg.o_groups, cfg.heads_per_group, cfg.head_dim
    grouped = o.reshape(b * t, g, j * k)
    stack = wo_a.stack if isinstance(wo_a, LayerOf) else wo_a
    if isinstance(stack, Quantized):
        heads, dims, lora = stack.blocks
        if (heads == 1 or dims == k) and j % heads == 0:
            lead = stack.codes.shape[:-3]  # (layers,) for a LayerOf's stack
            per_group = Quantized(
                stack.codes.reshape(*lead, g, j * k, -1),
                stack.scales.reshape(*lead, g, (j // heads) * (k // dims), -1),
                stack.format,
                (heads * dims, lora),
            )
            weights: Any = per_group
            groups_axis: Any = len(lead)
            if isinstance(wo_a, LayerOf):  # each group's matrices stay in their stack, read in place
                weights, groups_axis = LayerOf(per_group, wo_a.layer), LayerOf(groups_axis, None)
            out = jax.vmap(lambda x, w: kernels.einsum("mx,xo->mo", x, w), in_axes=(1, groups_axis), out_axes=1)(
                grouped, weights
            )
            return out.reshape(b, t, -1)
    dense_wo_a = dense(one_layer(wo_a), o.dtype).reshape(g, j * k, -1)
    return jnp.einsum("mgx,gxo->mgo", grouped, dense_wo_a).reshape(b, t, -1)


def keys(x: jax.Array, w: Attention, positions: jax.Array, freqs, cfg: ModelConfig, kernels: Kernels) -> jax.Array:
    """The K=V vectors of inputs x [b, t, d] at `positions` [b, t]: projected, normed, rotated."""
    kv = rms_norm(kernels.einsum("btd,dk->btk", x, w.wkv), w.kv_norm, cfg.rms_norm_eps)
    return apply_rope(kv, positions, freqs)


def writing_slots(inputs: StepInputs, num_rows: int) -> jax.Array:
    """The state row each row of a step writes: its slot, or past every row (dropped) for a padding row."""
    return jnp.where(inputs.lengths > 0, inputs.slots, num_rows)


def write_window(cache: LayerCache, layer: jax.Array, ring_rows: Any, kv: jax.Array, inputs: StepInputs) -> LayerCache:
    """The chunk's K=V [b, t, k] written into the rows' rings as read (`ring_rows`, from `inputs.state_source`), put
    back into the rows' slots, and into each snapshot row the ring as of its position."""
    b, t, _ = kv.shape
    window = cache.window.shape[2]
    qpos, valid = inputs.query_positions, inputs.token_mask
    write_slots = writing_slots(inputs, cache.window.shape[1])
    # Only the chunk's last W tokens survive in the ring; dropping the rest keeps the scatter duplicate-free.
    keep = valid & (jnp.arange(t)[None, :] >= inputs.lengths[:, None] - window)
    ring_index = jnp.where(keep, qpos % window, window)  # [b, t]; out of range -> dropped
    rows = write_kv(ring_rows, (jnp.arange(b)[:, None], ring_index), kv)
    # Whole rows go back: a write that depends on the read lets XLA update the stacked ring in place (a write
    # of the tokens alone is unordered with the read, and XLA copied the whole stack every layer to keep it).
    ring = scatter(cache.window, (layer, write_slots), rows)
    if inputs.snapshot_rows is not None:  # the ring as of each snapshot's position: its last W tokens before it
        assert inputs.snapshot_lengths is not None  # StepInputs sets the two together
        tokens = jnp.arange(t)[None, :]
        for j in range(inputs.snapshot_rows.shape[1]):
            ends = inputs.snapshot_lengths[:, j, None]
            upto = valid & (tokens < ends) & (tokens >= ends - window)
            snapshot = write_kv(ring_rows, (jnp.arange(b)[:, None], jnp.where(upto, qpos % window, window)), kv)
            ring = scatter(ring, (layer, inputs.snapshot_rows[:, j]), snapshot)
    return dataclasses.replace(cache, window=ring)
