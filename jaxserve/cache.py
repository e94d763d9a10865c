"""The KV state: device-side arrays (per-slot window ring and compressor state, paged pools of compressed
entries); the host-side page allocator is jaxserve.scheduler.allocator.

Layout (per layer):
- every layer: `window [slots, W, D]`, the last W post-norm, post-RoPE K=V vectors, token p at `p % W`;
- CSA/HCA layers: `entries [pages, page_size // m, D]`, the compressed entries, addressed through a row's
  page table; plus a `CompressorState` per slot (the partial window, and for the overlapped CSA kind the
  previous window's A-half);
- CSA layers also: `index_entries [pages, page_size // m, c_I]` and the indexer compressor's state.

The layers are stacked like the weights (`jaxserve.model.segments`): the cache is `[segment][position]` of
`LayerCache`s whose every leaf leads with a `layers` axis, so each array above is `[repeats, ...]`.

A page covers `page_size` tokens in every layer at once: one page table per sequence serves all layers.
Nothing here needs resetting when a slot is reused: every read is masked by the row's position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import CSA, HCA, SWA, EngineConfig, ModelConfig
from jaxserve.model.segments import layer_segments
from jaxserve.model.weights import ArrayInfo, is_info, map_infos, stack_infos

F32 = jnp.float32


@jax.tree_util.register_static
@dataclass(frozen=True)
class CacheGeometry:
    num_slots: int  # rows of per-sequence state (max concurrent sequences)
    num_pages: int  # pages in every compressed pool
    page_size: int  # tokens covered by one page
    max_pages_per_seq: int  # width of a page table

    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_pages_per_seq * self.page_size

    def validate(self, cfg: ModelConfig) -> None:
        for name in ("num_slots", "num_pages", "page_size", "max_pages_per_seq"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")
        rates = {cfg.compress_rate(i) for i in cfg.compressed_layers}
        if rates:
            multiple = math.lcm(*rates)
            if self.page_size % multiple:
                raise ValueError(f"page_size={self.page_size}: must be a multiple of {multiple} "
                                 f"(every compress rate in the model: {sorted(rates)})")


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def resolve_max_model_len(engine_cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """Prompt + completion tokens one sequence may hold: the knob, or the model's limit capped at 16384."""
    max_len = engine_cfg.max_model_len or min(model_cfg.max_position_embeddings, 16384)
    if max_len > model_cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                         f"{model_cfg.max_position_embeddings}")
    return max_len


def kv_geometry(engine_cfg: EngineConfig, model_cfg: ModelConfig) -> CacheGeometry:
    """The KV cache geometry these knobs ask for."""
    per_seq = pages_needed(resolve_max_model_len(engine_cfg, model_cfg), engine_cfg.page_size)
    num_pages = engine_cfg.num_kv_pages or engine_cfg.max_num_seqs * per_seq
    return CacheGeometry(num_slots=engine_cfg.max_num_seqs, num_pages=num_pages, page_size=engine_cfg.page_size,
                         max_pages_per_seq=per_seq)


@jax.tree_util.register_dataclass
@dataclass
class CompressorState:
    buf_kv: jax.Array  # [slots, m, coff*c] f32: projected kv of the current partial window, token p at p % m
    buf_gate: jax.Array  # [slots, m, coff*c] f32: its gate logits, position bias included
    prev_kv: jax.Array | None = None  # [slots, m, c] f32: A-half of the last complete window (overlap only)
    prev_gate: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclass
class LayerCache:
    window: jax.Array
    entries: jax.Array | None = None
    state: CompressorState | None = None
    index_entries: jax.Array | None = None
    index_state: CompressorState | None = None


def _compressor_state(slots: int, rate: int, width: int, overlap: bool) -> CompressorState:
    coff = 2 if overlap else 1
    buf = ArrayInfo((slots, rate, coff * width), F32, ("slots", None, None), "zeros")
    prev = ArrayInfo((slots, rate, width), F32, ("slots", None, None), "zeros") if overlap else None
    return CompressorState(buf_kv=buf, buf_gate=buf, prev_kv=prev, prev_gate=prev)


def _layer_cache(cfg: ModelConfig, geo: CacheGeometry, kind: str) -> LayerCache:
    dt, hd = cfg.dtype, cfg.head_dim
    window = ArrayInfo((geo.num_slots, cfg.sliding_window, hd), dt, ("slots", None, "head_dim"), "zeros")
    if kind == SWA:
        return LayerCache(window=window)
    rate = cfg.kind_rate(kind)
    per_page = geo.page_size // rate
    layer = LayerCache(window=window,
                       entries=ArrayInfo((geo.num_pages, per_page, hd), dt, ("pages", None, "head_dim"), "zeros"),
                       state=_compressor_state(geo.num_slots, rate, hd, overlap=kind == CSA))
    if kind == CSA:
        layer.index_entries = ArrayInfo((geo.num_pages, per_page, cfg.index_head_dim), dt, ("pages", None, None),
                                        "zeros")
        layer.index_state = _compressor_state(geo.num_slots, rate, cfg.index_head_dim, overlap=True)
    return layer


def abstract_cache(cfg: ModelConfig, geo: CacheGeometry) -> list[list[LayerCache]]:
    geo.validate(cfg)
    return [[stack_infos(_layer_cache(cfg, geo, kind.attention), segment.repeats) for kind in segment.pattern]
            for segment in layer_segments(cfg)]


def init_cache(cfg: ModelConfig, geo: CacheGeometry, shardings=None) -> list[list[LayerCache]]:
    abstract = abstract_cache(cfg, geo)
    if shardings is None:
        return map_infos(lambda info: jnp.zeros(info.shape, info.dtype), abstract)
    return jax.tree.map(lambda info, s: jnp.zeros(info.shape, info.dtype, device=s), abstract, shardings,
                        is_leaf=is_info)


def bytes_per_token(cfg: ModelConfig) -> float:
    """Bytes of compressed KV (both pools) one token adds, summed over layers."""
    item = jnp.dtype(cfg.dtype).itemsize
    total = 0.0
    for i, kind in enumerate(cfg.layer_kinds):
        if kind == CSA:
            total += (cfg.head_dim + cfg.index_head_dim) * item / cfg.csa_rate
        elif kind == HCA:
            total += cfg.head_dim * item / cfg.hca_rate
    return total


def cache_nbytes(cfg: ModelConfig, geo: CacheGeometry) -> dict[str, int]:
    """Bytes the cache allocates, split into the paged pools and the fixed per-slot state."""
    paged = fixed = 0
    for name_info in jax.tree.leaves(abstract_cache(cfg, geo), is_leaf=is_info):
        size = int(np.prod(name_info.shape)) * jnp.dtype(name_info.dtype).itemsize
        if "pages" in name_info.axes:
            paged += size
        else:
            fixed += size
    return {"paged": paged, "per_slot_fixed": fixed}
