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

The per-sequence state (window ring, compressor state) has `num_snapshots` more rows than slots: the prefix cache's
snapshots of a sequence's state at a page boundary. A prefill row may write its state as of a position inside its
chunk into one (`StepInputs.snapshot_rows`), and a later request's first chunk may read its state from one
(`StepInputs.state_rows`) while writing its own slot: a hit starts exactly where the snapshot was taken.

`kv_cache_dtype` (the geometry's) stores the window, entries and indexer keys as plain arrays of the model's dtype
(`auto`) or bfloat16, or as `Fp8KV` nodes (`fp8`, jaxserve.kernels.kv_quant): one uint8 row a vector, its codes,
scales and RoPE dims packed byte for byte (one gather or scatter a read or write):
- K=V vectors (window, entries): the D - R non-RoPE dims in e4m3 with one power-of-two scale (a ue8m0 byte) per
  block of 64 dims, the quantization DeepSeek-V4 was trained with on these dims; the R RoPE dims (the last ones)
  stay bfloat16, since positions need the precision. A head dim whose non-RoPE part is under 64 (tiny configs) is
  one block; one above 64 must be a multiple of 64.
- indexer keys: every dim e4m3 with one float32 scale per key, as the production layout stores them (only their
  ranking matters).
Compressor state stays float32. `read_kv` / `write_kv` take either form, so the model has no special case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import CSA, HCA, SWA, ConfigError, EngineConfig, ModelConfig, check_kv_cache_dtype
from jaxserve.kernels.kv_quant import Fp8KV, decode, encode
from jaxserve.model.segments import LayerKind, layer_segments
from jaxserve.model.weights import ArrayInfo, is_info, map_infos, nbytes, stack_infos, weights_nbytes
from jaxserve.paging import pages_needed

F32 = jnp.float32
FP8_KV = "fp8"  # the --kv-cache-dtype value (kernels.quant.FP8 names the e4m3 storage format)
FP8_BLOCK = 64  # non-RoPE dims per scale of a K=V vector


@jax.tree_util.register_static
@dataclass(frozen=True)
class CacheGeometry:
    num_slots: int  # rows of per-sequence state (max concurrent sequences)
    num_pages: int  # pages in every compressed pool
    page_size: int  # tokens covered by one page
    max_pages_per_seq: int  # width of a page table
    kv_cache_dtype: str = "auto"  # config.KV_CACHE_DTYPES (storage_dtype resolves `auto`)
    num_snapshots: int = 0  # rows of per-sequence state past the slots, for the prefix cache's snapshots
    draft_tokens: int = 0  # speculative decoding's drafts per step: each slot has this many more state rows

    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_pages_per_seq * self.page_size

    @property
    def state_rows(self) -> int:
        """Rows of every per-sequence state array: the slots, the snapshots (row num_slots + k), then each slot's
        draft rows (draft_row)."""
        return self.num_slots + self.num_snapshots + self.num_slots * self.draft_tokens

    @property
    def snapshot_rows(self) -> range:
        """The prefix cache's snapshot rows."""
        return range(self.num_slots, self.num_slots + self.num_snapshots)

    def draft_row(self, slot: int, tokens: int) -> int:
        """The state row that holds `slot`'s sequence state as of `tokens` (1 .. draft_tokens) tokens into a verify
        step: where a step that accepts fewer tokens than it ran takes its state back from."""
        assert 1 <= tokens <= self.draft_tokens, tokens
        return self.num_slots + self.num_snapshots + slot * self.draft_tokens + tokens - 1

    def validate(self, cfg: ModelConfig) -> None:
        for name in ("num_slots", "num_pages", "page_size", "max_pages_per_seq"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")
        if self.num_snapshots < 0 or self.draft_tokens < 0:
            raise ValueError(f"num_snapshots={self.num_snapshots}, draft_tokens={self.draft_tokens}: must be >= 0")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype == FP8_KV and cfg.v41:
            raise ConfigError(
                "kv_cache_dtype='fp8': DeepSeek-V4.1's KV is already rounded to FP8 and FP4 grids (32- and 16-channel "
                "blocks) that jaxserve's FP8 layout does not store exactly yet; use kv_cache_dtype='bfloat16', which "
                "holds those values exactly"
            )
        if self.kv_cache_dtype == FP8_KV:
            fp8_block(cfg)
        rates = {cfg.compress_rate(i) for i in cfg.compressed_layers}
        if rates:
            multiple = math.lcm(*rates)
            if self.page_size % multiple:
                raise ValueError(
                    f"page_size={self.page_size}: must be a multiple of {multiple} "
                    f"(every compress rate in the model: {sorted(rates)})"
                )


def resolve_max_model_len(engine_cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """Prompt + completion tokens one sequence may hold: the knob, or the model's limit capped at 16384."""
    max_len = engine_cfg.max_model_len or min(model_cfg.max_position_embeddings, 16384)
    if max_len > model_cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_len} exceeds the model's max_position_embeddings={model_cfg.max_position_embeddings}"
        )
    return max_len


def kv_geometry(engine_cfg: EngineConfig, model_cfg: ModelConfig) -> CacheGeometry:
    """The KV cache geometry these knobs ask for."""
    per_seq = pages_needed(resolve_max_model_len(engine_cfg, model_cfg), engine_cfg.page_size)
    num_pages = engine_cfg.num_kv_pages or engine_cfg.max_num_seqs * per_seq
    return CacheGeometry(
        num_slots=engine_cfg.max_num_seqs,
        num_pages=num_pages,
        page_size=engine_cfg.page_size,
        max_pages_per_seq=per_seq,
        kv_cache_dtype=engine_cfg.kv_cache_dtype,
        num_snapshots=engine_cfg.num_prefix_snapshots,
        draft_tokens=engine_cfg.draft_tokens,
    )


def storage_dtype(kv_cache_dtype: str, cfg: ModelConfig) -> str:
    """The dtype a KV knob stores: `auto` is the model's (as vLLM's)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return cfg.dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def fp8_block(cfg: ModelConfig) -> int:
    """Non-RoPE dims per scale of an FP8 K=V vector (ConfigError when they do not split into whole blocks)."""
    nope = cfg.head_dim - cfg.rope_head_dim
    block = min(FP8_BLOCK, nope)
    if block == 0 or nope % block:
        raise ConfigError(
            f"kv_cache_dtype='fp8': head_dim - qk_rope_head_dim = {cfg.head_dim} - "
            f"{cfg.rope_head_dim} = {nope} dims must be quantized in blocks of {FP8_BLOCK} (or one "
            f"block below {FP8_BLOCK}); use kv_cache_dtype='bfloat16'"
        )
    return block


@jax.tree_util.register_dataclass
@dataclass
class CompressorState:
    """A compressor's per-row state as one float32 array `packed [..., m, width]` (one gather or scatter a read or
    write, where four arrays took four kernels each), its parts side by side along the last axis:
    - buf_kv [..., m, coff*c]: projected kv of the current partial window, token p at p % m;
    - buf_gate [..., m, coff*c]: its gate logits, position bias included;
    - overlapped kind only: prev_kv, prev_gate [..., m, c], the A-half of the last complete window.
    (coff = 2 for the overlapped kind, else 1.)"""

    packed: Any
    c: int = field(metadata=dict(static=True))  # the entry width
    overlap: bool = field(metadata=dict(static=True))

    @staticmethod
    def width(c: int, overlap: bool) -> int:
        return 6 * c if overlap else 2 * c

    @classmethod
    def pack(
        cls,
        buf_kv: jax.Array,
        buf_gate: jax.Array,
        prev_kv: jax.Array | None = None,
        prev_gate: jax.Array | None = None,
    ) -> CompressorState:
        previous = [part for part in (prev_kv, prev_gate) if part is not None]
        overlap = bool(previous)
        parts = [buf_kv, buf_gate, *previous]
        c = buf_kv.shape[-1] // (2 if overlap else 1)
        return cls(jnp.concatenate(parts, axis=-1), c, overlap)

    def _part(self, start: int, size: int) -> jax.Array:
        return self.packed[..., start : start + size]

    @property
    def buf_kv(self) -> jax.Array:
        return self._part(0, self._buf)

    @property
    def buf_gate(self) -> jax.Array:
        return self._part(self._buf, self._buf)

    @property
    def prev_kv(self) -> jax.Array | None:
        return self._part(2 * self._buf, self.c) if self.overlap else None

    @property
    def prev_gate(self) -> jax.Array | None:
        return self._part(2 * self._buf + self.c, self.c) if self.overlap else None

    @property
    def _buf(self) -> int:
        return (2 if self.overlap else 1) * self.c


@jax.tree_util.register_dataclass
@dataclass
class LayerCache:
    window: jax.Array | Fp8KV
    entries: jax.Array | Fp8KV | None = None
    state: CompressorState | None = None
    index_entries: jax.Array | Fp8KV | None = None
    index_state: CompressorState | None = None


def gather(store: Any, index: tuple) -> Any:
    """Rows of a store (an array, an Fp8KV, a CompressorState): `leaf[index]` for every leaf, indexing leading
    axes only."""
    return jax.tree.map(lambda a: a[index], store)


def scatter(store: Any, index: tuple, rows: Any) -> Any:
    """`store` with `rows` (in its form) written at `index`; out-of-range indices are dropped."""
    return jax.tree.map(lambda a, r: a.at[index].set(r, mode="drop"), store, rows)


def read_kv(store: jax.Array | Fp8KV, index: tuple, dtype: Any) -> jax.Array:
    """Stored K=V vectors or indexer keys at `index`, decoded to `dtype`."""
    return decode(gather(store, index), dtype)


def write_kv(store: jax.Array | Fp8KV, index: tuple, values: jax.Array) -> jax.Array | Fp8KV:
    """`store` with `values [..., width]` encoded to its form and written at `index` (out of range: dropped)."""
    return scatter(store, index, encode(values, store))


def _compressor_state(slots: int, rate: int, width: int, overlap: bool) -> CompressorState:
    packed = ArrayInfo((slots, rate, CompressorState.width(width, overlap)), F32, ("slots", None, None), "zeros")
    # The abstract state: an ArrayInfo leaf where the live cache's CompressorState holds its array.
    return CompressorState(packed, width, overlap)


def _kv_store(
    cfg: ModelConfig, kv_cache_dtype: str, lead: tuple[int, ...], lead_axes: tuple[str | None, ...], index: bool
) -> ArrayInfo | Fp8KV:
    """A store of K=V vectors (`index` False) or indexer keys (True) with leading axes `lead`."""
    width, axis = (cfg.index_head_dim, None) if index else (cfg.head_dim, "head_dim")
    dtype = storage_dtype(kv_cache_dtype, cfg)
    if dtype != FP8_KV:
        return ArrayInfo((*lead, width), dtype, (*lead_axes, axis), "zeros")
    rope = 0 if index else cfg.rope_head_dim
    block = width if index else fp8_block(cfg)
    n = width - rope
    scale_dtype = F32 if index else jnp.uint8
    row = Fp8KV.row_bytes(n, block, rope, scale_dtype)
    packed = ArrayInfo((*lead, row), jnp.uint8, (*lead_axes, None), "zeros")
    return Fp8KV(packed, n, block, rope, jnp.dtype(scale_dtype).name)


def _layer_cache(cfg: ModelConfig, geo: CacheGeometry, kind: str) -> LayerCache:
    def store(lead, lead_axes, index=False):
        return _kv_store(cfg, geo.kv_cache_dtype, lead, lead_axes, index)

    window = store((geo.state_rows, cfg.sliding_window), ("slots", None))
    if kind == SWA:
        return LayerCache(window=window)
    rate = cfg.kind_rate(kind)
    per_page = geo.page_size // rate
    layer = LayerCache(
        window=window,
        entries=store((geo.num_pages, per_page), ("pages", None)),
        state=_compressor_state(geo.state_rows, rate, cfg.head_dim, overlap=kind == CSA),
    )
    if kind == CSA:
        layer.index_entries = store((geo.num_pages, per_page), ("pages", None), index=True)
        layer.index_state = _compressor_state(geo.state_rows, rate, cfg.index_head_dim, overlap=True)
    return layer


def _shared_kv_layer_cache(cfg: ModelConfig, geo: CacheGeometry, kind: LayerKind) -> LayerCache:
    """A DeepSeek-V4.1 layer's state: its window; a KV source's also its group's compressed entries and indexer keys
    (the layers that share them hold none) and, pooling more than one token an entry, its compressor's partial group."""
    layer = _layer_cache(cfg, geo, SWA)
    if not kind.kv_source:
        return layer
    per_page = geo.page_size // kind.rate

    def pool(index: bool) -> Any:  # the abstract cache: an ArrayInfo where the live one holds its array
        return _kv_store(cfg, geo.kv_cache_dtype, (geo.num_pages, per_page), ("pages", None), index)

    state = _compressor_state(geo.state_rows, kind.rate, cfg.head_dim, overlap=False) if kind.rate > 1 else None
    return LayerCache(window=layer.window, entries=pool(False), state=state, index_entries=pool(True))


def abstract_cache(cfg: ModelConfig, geo: CacheGeometry) -> list[list[LayerCache]]:
    geo.validate(cfg)

    def layer_cache(kind: LayerKind) -> LayerCache:
        return _shared_kv_layer_cache(cfg, geo, kind) if cfg.v41 else _layer_cache(cfg, geo, kind.attention)

    return [
        [stack_infos(layer_cache(kind), segment.repeats) for kind in segment.pattern] for segment in layer_segments(cfg)
    ]


def init_cache(cfg: ModelConfig, geo: CacheGeometry, shardings=None) -> list[list[LayerCache]]:
    return zeros_of(abstract_cache(cfg, geo), shardings)


def zeros_of(abstract: Any, shardings: Any = None) -> Any:
    """Zeros for every ArrayInfo leaf of an abstract tree (a cache), placed with `shardings` when given."""
    if shardings is None:
        return map_infos(lambda info: jnp.zeros(info.shape, info.dtype), abstract)
    return jax.tree.map(
        lambda info, s: jnp.zeros(info.shape, info.dtype, device=s), abstract, shardings, is_leaf=is_info
    )


def entry_bytes(cfg: ModelConfig, kv_cache_dtype: str = "auto", index: bool = False) -> int:
    """Bytes of one stored compressed entry (`index` False) or indexer key (True)."""
    return weights_nbytes(_kv_store(cfg, kv_cache_dtype, (1,), (None,), index))


def bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str = "auto") -> float:
    """Bytes of compressed KV (both pools: codes, scales and RoPE dims when FP8) one token adds, summed over
    layers."""

    def entry(index=False):
        return entry_bytes(cfg, kv_cache_dtype, index)

    total = 0.0
    if cfg.shared_kv is not None:  # DeepSeek-V4.1: only the KV sources store entries, for their whole group
        kv = cfg.shared_kv
        return sum((entry() + entry(index=True)) / kv.ratios[i] for i in kv.kv_sources)
    for kind in cfg.layer_kinds:
        if kind == CSA:
            total += (entry() + entry(index=True)) / cfg.csa_rate
        elif kind == HCA:
            total += entry() / cfg.hca_rate
    return total


def cache_nbytes(cfg: ModelConfig, geo: CacheGeometry) -> dict[str, int]:
    """Bytes the cache allocates, split into the paged pools and the fixed per-sequence state (every state row:
    the slots and the prefix cache's snapshots)."""
    paged = fixed = 0
    for info in jax.tree.leaves(abstract_cache(cfg, geo), is_leaf=is_info):
        size = nbytes(info)
        if "pages" in info.axes:
            paged += size
        else:
            fixed += size
    return {"paged": paged, "per_slot_fixed": fixed}


def abstract_dspark_cache(cfg: ModelConfig, geo: CacheGeometry) -> LayerCache:
    """The DSpark drafter's state: each stage's window ring of context keys, stacked [S, state rows, W, k]."""
    geo.validate(cfg)
    assert cfg.dspark is not None  # drafting with DSpark needs its config
    return stack_infos(_layer_cache(cfg, geo, SWA), cfg.dspark.stages)


def abstract_mtp_cache(cfg: ModelConfig, geo: CacheGeometry) -> list[LayerCache]:
    """The state of each MTP block the model holds: one sliding-window layer, stacked as one repeat."""
    geo.validate(cfg)
    return [stack_infos(_layer_cache(cfg, geo, SWA), 1) for _ in range(cfg.mtp_layers)]
