"""The weights as registered-dataclass pytrees, described abstractly first.

`abstract_weights(cfg)` returns the same tree with an `ArrayInfo` at every leaf (shape, dtype, logical
axes, how to initialise). Initialisation, shardings and checkpoint restore targets are all derived from
it, so the three can never disagree. Projections are stored input-major (`x @ W`), the transpose of the
checkpoint's `[out, in]` layout.

A weight the config keeps quantized (`cfg.linear_format`, `cfg.expert_format`) is a `Quantized` node instead:
its codes and its scales are two ArrayInfos with the weight's logical axes, so both are sharded alike, and its
blocks are the release's (128x128 for FP8 `[out, in]`, 1x32 for FP4) carried onto our layout's axes.

The layers are stacked as the layer plan says (`jaxserve.model.segments`): `Weights.segments[s][p]` is one
`Layer` whose every leaf leads with a `layers` axis. Checkpoints name leaves per layer (`layers.3.attn.wq_b`);
`release_leaves` maps those names to their place in the stacks.

Leaves with a `vocab` axis (the embedding, the LM head, the hash-routing tables) hold `cfg.padded_vocab_size` rows:
the checkpoint's `vocab_size` and zero rows up to a multiple of the ways the mesh splits the vocabulary
(`LayerLeaf.stored` is the checkpoint's shape).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import CSA, SWA, ConfigError, ModelConfig
from jaxserve.kernels.quant import FP4, Quantized, codes_dtype, codes_shape, quantize, scales_shape
from jaxserve.model.engram import SCALE_BLOCK
from jaxserve.model.segments import LayerKind, layer_segments

F32 = jnp.float32


@dataclass(frozen=True)
class ArrayInfo:
    """A leaf of the abstract weights: what the array is, before it exists."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]  # logical axis names, mapped to mesh axes by jaxserve.model.sharding
    init: str = "normal"  # normal | ones | zeros | small | expert_ids
    memory: str | None = None  # the memory kind that holds it (None: the devices'; "pinned_host": the host's)

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


@jax.tree_util.register_dataclass
@dataclass
class HyperConnection:
    fn: Any  # [hc*d, (2+hc)*hc]: pre | post | comb (row-major hc x hc)
    base: Any  # [(2+hc)*hc]
    scale: Any  # [3]


@jax.tree_util.register_dataclass
@dataclass
class Compressor:
    wkv: Any  # [d, coff*c]
    wgate: Any  # [d, coff*c]; None: DeepSeek-V4.1 at ratio 1 (every token its own entry, nothing pooled)
    ape: Any  # [m, coff*c], per-slot position bias added to the gate; None: DeepSeek-V4.1 (it has none)
    norm: Any  # [c]


@jax.tree_util.register_dataclass
@dataclass
class Indexer:
    compressor: Compressor | None  # DeepSeek-V4's own compressor of the indexer keys (V4.1: none)
    wq_b: Any  # [q_lora, n_I, c_I]
    weights_proj: Any  # [d, n_I]
    # DeepSeek-V4.1's KV sources: the indexer keys made from the compressor's latent, k_norm(latent @ wk).
    wk: Any = None  # [c, c_I]
    k_norm: Any = None  # [c_I]


@jax.tree_util.register_dataclass
@dataclass
class Engram:
    """DeepSeek-V4.1's Engram memory at one layer (jaxserve.model.engram): the hashed n-gram rows' table, their
    projection to a key per hc stream and one shared value, and the gate's weights (used only as their product)."""

    table: Any  # [rows, head_dim]: FP8 with one scale per 32 channels of a row, as the release stores it
    wkv: Any  # [columns * head_dim, (hc + 1) * d]
    q_weight: Any  # [hc, d]
    k_weight: Any  # [hc, d]


@jax.tree_util.register_dataclass
@dataclass
class Attention:
    wq_a: Any  # [d, q_lora]
    q_norm: Any  # [q_lora]
    wq_b: Any  # [q_lora, H, D]
    wkv: Any  # [d, D]
    kv_norm: Any  # [D]
    wo_a: Any  # [H, D, o_lora]; heads k*H/g..(k+1)*H/g-1 form group k
    wo_b: Any  # [g*o_lora, d]
    sinks: Any  # [H]
    compressor: Compressor | None = None
    indexer: Indexer | None = None


@jax.tree_util.register_dataclass
@dataclass
class MoE:
    router: Any  # [d, E]
    w_gate: Any  # [E, d, f]
    w_up: Any  # [E, d, f]
    w_down: Any  # [E, f, d]
    shared_gate: Any  # [d, f]
    shared_up: Any  # [d, f]
    shared_down: Any  # [f, d]
    score_bias: Any = None  # [E], selection-only bias (score-routed layers)
    tid2eid: Any = None  # [V, k], the fixed token -> experts table (hash-routed layers)


@jax.tree_util.register_dataclass
@dataclass
class RoutedExperts:
    """A segment's routed experts, every layer's ([layers, E, ...]): what the layer scan does not slice."""

    w_gate: Any
    w_up: Any
    w_down: Any

    @staticmethod
    def split(layer: Layer) -> tuple[Layer, RoutedExperts]:
        """(`layer` without its routed experts, those experts)."""
        moe = layer.moe
        rest = dataclasses.replace(layer, moe=dataclasses.replace(moe, w_gate=None, w_up=None, w_down=None))
        return rest, RoutedExperts(moe.w_gate, moe.w_up, moe.w_down)


# The layer's weights, besides the projections, that kernels read from a segment's stacks in place (as `LayerOf`
# views; sliced out, each is copied every step): the block-input norms, which the mHC collapse folds in, replicated
# on every mesh like the hyper-connections' own weights, so read in place on any mesh; and those read in place on one
# device as the projections are (the query's low-rank norm, which its projections fold in; the attention sinks).
BLOCK_NORMS = ("attn_norm", "ffn_norm")
ONE_DEVICE_IN_PLACE = ("q_norm", "sinks")
# Read in place on any mesh and any placement: DeepSeek-V4.1's Engram tables, of which a step gathers a few rows
# (sliced out of their stack, a table would be copied; in host memory, the slice would not stay there).
ALWAYS_IN_PLACE = ("table",)


@jax.tree_util.register_dataclass
@dataclass
class Layer:
    attn_hc: HyperConnection
    attn_norm: Any  # [d]
    attn: Attention
    ffn_hc: HyperConnection
    ffn_norm: Any  # [d]
    moe: MoE
    engram: Engram | None = None  # DeepSeek-V4.1's Engram layers


@jax.tree_util.register_dataclass
@dataclass
class MTPBlock:
    """A next-token-prediction block (the release's `mtp.N`): the main model's last hidden streams at position i and
    the embedding of token i+1 go in, a guess at token i+2 comes out through the shared embedding and head."""

    e_proj: Any  # [d, d], the normed embedding's projection
    h_proj: Any  # [d, d], the normed hidden streams' projection
    enorm: Any  # [d]
    hnorm: Any  # [d]
    block: Layer  # a sliding-window, score-routed layer, stacked as one repeat ([1, ...]) so the layer code runs it
    hc_head_fn: Any  # [hc*d, hc]
    hc_head_base: Any  # [hc]
    hc_head_scale: Any  # [1]
    norm: Any  # [d]


@jax.tree_util.register_dataclass
@dataclass
class DSparkDrafter:
    """DeepSeek-V4 0731 / 0813's block drafter (jaxserve.model.dspark): the target's hidden states at the tapped
    layers projected to one context feature a position, decoder layers of sliding-window attention over those
    features' keys and the block's own, and a Markov head that conditions each drafted token on the one before."""

    main_proj: Any  # [taps*d, d], the concatenated tapped hidden states' projection (release: mtp.0.main_proj)
    main_norm: Any  # [d]
    stages: Layer  # the drafter's decoder layers (mtp.0 .. mtp.S-1), stacked [S, ...]
    hc_head_fn: Any  # [hc*d, hc] (the last stage's)
    hc_head_base: Any  # [hc]
    hc_head_scale: Any  # [1]
    norm: Any  # [d]
    markov_embed: Any  # [V, r]: markov_w1, the previous token's embedding
    markov_out: Any  # [r, V]: markov_w2, its logits


@jax.tree_util.register_dataclass
@dataclass
class Weights:
    embed: Any  # [V, d]
    segments: list[list[Layer]]  # [segment][position in its pattern], every leaf stacked: [repeats, ...]
    hc_head_fn: Any  # [hc*d, hc]; None (and base, scale): DeepSeek-V4.1, whose last site's weights collapse
    hc_head_base: Any  # [hc]
    hc_head_scale: Any  # [1]
    norm: Any  # [d]
    head: Any  # [d, V]
    mtp: list[MTPBlock] = dataclasses.field(default_factory=list)  # the blocks `cfg.mtp_layers` holds
    dspark: DSparkDrafter | None = None  # held when `cfg.dspark_drafting`
    # DeepSeek-V4.1's Engram: every token id's hash products ([V + 1, Engram layers, max n-gram, 2] uint32,
    # jaxserve.model.engram.product_table), made from the tokenizer at load (DERIVED_LEAVES), not read
    ngram_products: Any = None


# Leaves made at load from something other than the checkpoint's tensors (the tokenizer): no release name, zeros
# until the loader makes them (jaxserve.checkpoints.load).
DERIVED_LEAVES = ("ngram_products",)


# ---- the abstract description ---------------------------------------------------------------------------------

FP8_BLOCK = 128  # the release's FP8 blocks: 128 x 128 of an `[out, in]` tensor
ENGRAM_TABLE_BLOCKS = (1, SCALE_BLOCK)  # V4.1's Engram tables: one scale per 32 channels of a row
HOST_MEMORY = "pinned_host"  # the memory kind of what lives in the host's memory (--engram-placement host)
FP4_BLOCK = 32  # the release's FP4 blocks: 1 x 32 along the input


def _split_block(block: int, outer: int, inner: int, what: str) -> tuple[int, int]:
    """A block of `block` consecutive elements of a dim stored as [outer, inner] (row-major), as a block on each of
    the two axes; a block that starts and ends mid-row cannot be one."""
    if inner % block == 0:
        return 1, block
    if block % inner == 0:
        return min(block // inner, outer), inner
    raise ConfigError(
        f"{what}: its {block}-element quantization blocks straddle rows of {inner}, so its scales "
        "cannot follow our layout; load it with --quantization none"
    )


def _weight(
    shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: Any, fmt: str | None, blocks: tuple[int, ...]
) -> ArrayInfo | Quantized:
    """A weight dense in `dtype` (fmt None) or kept quantized, `blocks` decoded elements per scale on each axis."""
    if fmt is None:
        return ArrayInfo(shape, dtype, axes)
    if fmt == FP4:
        blocks = tuple(FP4_BLOCK if i == len(shape) - 2 else 1 for i in range(len(shape)))  # 1x32 along the input
    blocks = tuple(min(b, n) for b, n in zip(blocks, shape))
    # Where one block spans a whole axis its single scale is replicated, so the codes may be split along it freely.
    scale_axes = tuple(None if b == n else a for a, b, n in zip(axes, blocks, shape))
    return Quantized(
        codes=ArrayInfo(codes_shape(fmt, shape), codes_dtype(fmt), axes),
        scales=ArrayInfo(scales_shape(shape, blocks), jnp.uint8, scale_axes),
        format=fmt,
        blocks=blocks,
    )


def _projection(cfg: ModelConfig, shape: tuple[int, int], axes: tuple[str | None, str | None]):
    """An input-major [in, out] projection the release ships as FP8 (square blocks either way round: 128 x 128 in
    V4, 32 x 32 in V4.1)."""
    return _weight(shape, axes, cfg.dtype, cfg.linear_format, (cfg.fp8_block, cfg.fp8_block))


def _heads_projection(cfg: ModelConfig, rows: int, heads: int, width: int, axes, what: str):
    """[in, heads, width], the release's [heads * width, in]: its blocks' rows split over heads and width."""
    fmt, block = cfg.linear_format, cfg.fp8_block
    blocks = (block, *_split_block(block, heads, width, what)) if fmt else ()
    return _weight((rows, heads, width), axes, cfg.dtype, fmt, blocks)


def _grouped_output(cfg: ModelConfig):
    """wo_a [heads, head_dim, o_lora], the release's [groups * o_lora, heads_per_group * head_dim]: the heads axis
    mixes a group (from the release's rows) and a head within it (from its columns)."""
    g, j, k, o = cfg.o_groups, cfg.heads_per_group, cfg.head_dim, cfg.o_lora_rank
    fmt, block = cfg.linear_format, cfg.fp8_block
    blocks: tuple[int, ...] = ()
    if fmt:
        per_group, per_lora = _split_block(block, g, o, "attn.wo_a")
        per_head, per_dim = _split_block(block, j, k, "attn.wo_a")
        if per_head == j:
            heads = per_group * j
        elif j % per_head == 0:
            heads = per_head
        else:
            raise ConfigError(
                f"attn.wo_a: its {block}-element blocks split a group's {j} heads unevenly; "
                "load it with --quantization none"
            )
        blocks = (heads, per_dim, per_lora)
    return _weight((g * j, k, o), ("heads", "head_dim", "o_lora"), cfg.dtype, fmt, blocks)


def _experts(cfg: ModelConfig, shape: tuple[int, int, int], axes):
    """Routed experts [e, in, out]: the release's per-expert [out, in] in FP4 (1x32) or FP8 (square blocks)."""
    return _weight(shape, axes, cfg.dtype, cfg.expert_format, (1, cfg.fp8_block, cfg.fp8_block))


def _hyper_connection(cfg: ModelConfig) -> HyperConnection:
    n, d = cfg.hc_mult, cfg.hidden_size
    mixes = (2 + n) * n
    return HyperConnection(
        fn=ArrayInfo((n * d, mixes), F32, ("hc_embed", None)),
        base=ArrayInfo((mixes,), F32, (None,), "small"),
        scale=ArrayInfo((3,), F32, (None,), "ones"),
    )


def _compressor(cfg: ModelConfig, rate: int, width: int, overlap: bool) -> Compressor:
    coff = 2 if overlap else 1
    d = cfg.hidden_size
    # Stored as the release ships them (in the engine's dtype); the compressor's maths run in float32.
    return Compressor(
        wkv=ArrayInfo((d, coff * width), cfg.dtype, ("embed", None)),
        wgate=ArrayInfo((d, coff * width), cfg.dtype, ("embed", None)),
        ape=ArrayInfo((rate, coff * width), F32, (None, None), "small"),
        norm=ArrayInfo((width,), F32, (None,), "ones"),
    )


def _v41_compressor(cfg: ModelConfig, kind: LayerKind) -> Compressor:
    """A DeepSeek-V4.1 KV source's compressor: no position bias, and at ratio 1 no gate (nothing is pooled)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    gate = ArrayInfo((d, hd), cfg.dtype, ("embed", None)) if kind.rate > 1 else None
    return Compressor(
        wkv=ArrayInfo((d, hd), F32, ("embed", None)), wgate=gate, ape=None, norm=ArrayInfo((hd,), F32, (None,), "ones")
    )


def _v41_attention(cfg: ModelConfig, attn: Attention, kind: LayerKind) -> Attention:
    """A DeepSeek-V4.1 layer's attention: a KV source owns its group's compressor, an index source an indexer (a KV
    source's also makes the group's indexer keys)."""
    if kind.attention == SWA:
        return attn
    compressor = _v41_compressor(cfg, kind) if kind.kv_source else None
    indexer = None
    if kind.index_source:
        c, ci = cfg.head_dim, cfg.index_head_dim
        indexer = Indexer(
            compressor=None,
            wq_b=_heads_projection(
                cfg, cfg.q_lora_rank, cfg.index_n_heads, ci, ("q_lora", "index_heads", None), "attn.indexer.wq_b"
            ),
            weights_proj=ArrayInfo((cfg.hidden_size, cfg.index_n_heads), F32, ("embed", "index_heads")),
            wk=ArrayInfo((c, ci), F32, (None, None)) if kind.kv_source else None,
            k_norm=ArrayInfo((ci,), F32, (None,), "ones") if kind.kv_source else None,
        )
    return dataclasses.replace(attn, compressor=compressor, indexer=indexer)


def _engram(cfg: ModelConfig, place: int) -> Engram:
    """The Engram weights of the `place`-th Engram layer."""
    engram = cfg.engram
    assert engram is not None  # an Engram layer's config has one
    n, d, hd = cfg.hc_mult, cfg.hidden_size, engram.head_dim
    rows = cfg.padded_rows(engram.num_embeddings[place])
    table = _weight((rows, hd), ("engram_rows", None), cfg.dtype, cfg.linear_format, ENGRAM_TABLE_BLOCKS)
    if cfg.engram_on_host:
        table = map_infos(lambda info: dataclasses.replace(info, memory=HOST_MEMORY), table)
    return Engram(
        table=table,
        wkv=_projection(cfg, (engram.columns * hd, (n + 1) * d), (None, None)),
        q_weight=ArrayInfo((n, d), F32, (None, None), "ones"),
        k_weight=ArrayInfo((n, d), F32, (None, None), "ones"),
    )


def _attention(cfg: ModelConfig, kind: str) -> Attention:
    d, h, hd, r = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    attn = Attention(
        wq_a=_projection(cfg, (d, r), ("embed", "q_lora")),
        q_norm=ArrayInfo((r,), F32, (None,), "ones"),
        wq_b=_heads_projection(cfg, r, h, hd, ("q_lora", "heads", "head_dim"), "attn.wq_b"),
        wkv=_projection(cfg, (d, hd), ("embed", "head_dim")),
        kv_norm=ArrayInfo((hd,), F32, (None,), "ones"),
        wo_a=_grouped_output(cfg),
        wo_b=_projection(cfg, (cfg.o_groups * cfg.o_lora_rank, d), ("o_groups_lora", "embed")),
        sinks=ArrayInfo((h,), F32, ("heads",), "small"),
    )
    if kind == SWA:
        return attn
    if kind == CSA:
        indexer = Indexer(
            compressor=_compressor(cfg, cfg.csa_rate, cfg.index_head_dim, overlap=True),
            wq_b=_heads_projection(
                cfg, r, cfg.index_n_heads, cfg.index_head_dim, ("q_lora", "index_heads", None), "attn.indexer.wq_b"
            ),
            weights_proj=ArrayInfo((d, cfg.index_n_heads), F32, ("embed", "index_heads")),
        )
        return dataclasses.replace(attn, compressor=_compressor(cfg, cfg.csa_rate, hd, overlap=True), indexer=indexer)
    return dataclasses.replace(attn, compressor=_compressor(cfg, cfg.hca_rate, hd, overlap=False))


def _moe(cfg: ModelConfig, hashed: bool) -> MoE:
    d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    return MoE(
        router=ArrayInfo((d, e), F32, ("embed", None)),
        w_gate=_experts(cfg, (e, d, f), ("experts", "embed", "expert_ffw")),
        w_up=_experts(cfg, (e, d, f), ("experts", "embed", "expert_ffw")),
        w_down=_experts(cfg, (e, f, d), ("experts", "expert_ffw", "embed")),
        shared_gate=_projection(cfg, (d, f), ("embed", "ffw")),
        shared_up=_projection(cfg, (d, f), ("embed", "ffw")),
        shared_down=_projection(cfg, (f, d), ("ffw", "embed")),
        score_bias=None if hashed else ArrayInfo((e,), F32, (None,), "small"),
        tid2eid=ArrayInfo((cfg.padded_vocab_size, cfg.num_experts_per_tok), jnp.int32, ("vocab", None), "expert_ids")
        if hashed
        else None,
    )


def _layer(cfg: ModelConfig, kind: LayerKind) -> Layer:
    d = cfg.hidden_size
    attn = _attention(cfg, SWA if cfg.v41 else kind.attention)
    return Layer(
        attn_hc=_hyper_connection(cfg),
        attn_norm=ArrayInfo((d,), F32, (None,), "ones"),
        attn=_v41_attention(cfg, attn, kind) if cfg.v41 else attn,
        ffn_hc=_hyper_connection(cfg),
        ffn_norm=ArrayInfo((d,), F32, (None,), "ones"),
        moe=_moe(cfg, kind.hashed),
        engram=_engram(cfg, kind.engram) if kind.engram >= 0 else None,
    )


def stack_infos(tree: Any, repeats: int) -> Any:
    """An abstract (sub)tree with a leading `layers` axis of size `repeats` on every leaf."""
    return map_infos(
        lambda info: ArrayInfo((repeats, *info.shape), info.dtype, ("layers", *info.axes), info.init, info.memory),
        tree,
    )


MTP_KIND = LayerKind(SWA, hashed=False)  # every MTP block's layer (the release's compress ratio 0 for it)


def _hc_head(cfg: ModelConfig) -> tuple[ArrayInfo, ArrayInfo, ArrayInfo]:
    n = cfg.hc_mult
    return (
        ArrayInfo((n * cfg.hidden_size, n), F32, ("hc_embed", None)),
        ArrayInfo((n,), F32, (None,), "small"),
        ArrayInfo((1,), F32, (None,), "ones"),
    )


def _mtp_block(cfg: ModelConfig) -> MTPBlock:
    d = cfg.hidden_size
    fn, base, scale = _hc_head(cfg)
    return MTPBlock(
        e_proj=_projection(cfg, (d, d), ("embed", None)),
        h_proj=_projection(cfg, (d, d), ("embed", None)),
        enorm=ArrayInfo((d,), F32, (None,), "ones"),
        hnorm=ArrayInfo((d,), F32, (None,), "ones"),
        block=stack_infos(_layer(cfg, MTP_KIND), 1),
        hc_head_fn=fn,
        hc_head_base=base,
        hc_head_scale=scale,
        norm=ArrayInfo((d,), F32, (None,), "ones"),
    )


def _dspark_drafter(cfg: ModelConfig) -> DSparkDrafter | None:
    draft = cfg.dspark
    if not cfg.dspark_drafting or draft is None:
        return None
    d, v, r = cfg.hidden_size, cfg.padded_vocab_size, draft.markov_rank
    fn, base, scale = _hc_head(cfg)
    return DSparkDrafter(
        main_proj=ArrayInfo((len(draft.target_layer_ids) * d, d), cfg.dtype, (None, "embed")),
        main_norm=ArrayInfo((d,), F32, (None,), "ones"),
        stages=stack_infos(_layer(cfg, MTP_KIND), draft.stages),
        hc_head_fn=fn,
        hc_head_base=base,
        hc_head_scale=scale,
        norm=ArrayInfo((d,), F32, (None,), "ones"),
        markov_embed=ArrayInfo((v, r), cfg.dtype, ("vocab", None)),
        markov_out=ArrayInfo((r, v), cfg.dtype, (None, "vocab")),
    )


# The drafter's leaves that the release names after its last stage (`mtp.S-1.norm`, ...) or its first
# (`mtp.0.main_proj`), or by the head they belong to.
_DSPARK_NAMES = {
    "main_proj": "mtp.0.main_proj",
    "main_norm": "mtp.0.main_norm",
    "markov_embed": "mtp.{last}.markov_head.markov_w1",
    "markov_out": "mtp.{last}.markov_head.markov_w2",
}


def abstract_weights(cfg: ModelConfig) -> Weights:
    d, v = cfg.hidden_size, cfg.padded_vocab_size
    fn, base, scale = (None, None, None) if cfg.v41 else _hc_head(cfg)
    return Weights(
        embed=ArrayInfo((v, d), cfg.dtype, ("vocab", "embed")),
        segments=[
            [stack_infos(_layer(cfg, kind), segment.repeats) for kind in segment.pattern]
            for segment in layer_segments(cfg)
        ],
        hc_head_fn=fn,
        hc_head_base=base,
        hc_head_scale=scale,
        norm=ArrayInfo((d,), F32, (None,), "ones"),
        head=ArrayInfo((d, v), cfg.dtype, ("embed", "vocab")),
        mtp=[_mtp_block(cfg) for _ in range(cfg.mtp_layers)],
        dspark=_dspark_drafter(cfg),
        ngram_products=_ngram_products(cfg),
    )


def _ngram_products(cfg: ModelConfig) -> ArrayInfo | None:
    engram = cfg.engram
    if engram is None:
        return None
    shape = (cfg.vocab_size + 1, len(engram.layer_ids), engram.max_ngram, 2)
    return ArrayInfo(shape, jnp.uint32, (None,) * 4, "zeros")


def is_info(x: Any) -> bool:
    return isinstance(x, ArrayInfo)


def is_weight(x: Any) -> bool:
    """A whole weight of an abstract tree: an ArrayInfo, or a Quantized node of two (codes and scales)."""
    return isinstance(x, (ArrayInfo, Quantized))


def map_infos(fn: Callable[[ArrayInfo], Any], tree: Any) -> Any:
    return jax.tree.map(fn, tree, is_leaf=is_info)


def flatten_with_names(tree: Any, is_leaf: Callable[[Any], bool] = is_info) -> list[tuple[str, Any]]:
    """(dotted path, leaf) pairs, e.g. ('segments.2.1.attn.wq_b', ...), in flatten order (a quantized weight's
    parts: '....wq_b.codes', '....wq_b.scales'; with `is_leaf=is_weight`, the weight itself)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(_path_name(path), leaf) for path, leaf in leaves]


def _path_name(path) -> str:
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        else:
            parts.append(str(getattr(key, "key", key)))
    return ".".join(parts)


# ---- the per-layer view -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerLeaf:
    """One leaf as the un-stacked model has it (the checkpoint's view), and where it lives in the stacked Weights."""

    name: str  # as the release names it: 'layers.3.attn.wq_b', 'embed'
    path: str  # the Weights leaf that holds it: 'segments.2.1.attn.wq_b', 'embed'
    index: int | None  # its place along that leaf's leading `layers` axis; None outside the layers
    info: ArrayInfo | Quantized  # its own shape (no layers axis), dtype, logical axes (of codes and scales)
    # As checkpoints store it: `info` with the real vocabulary (cfg.vocab_size) where the devices hold it padded
    # (cfg.padded_vocab_size); the padding is zero rows, put on by `padded` and taken off by `unpadded`.
    stored: ArrayInfo | Quantized

    def padded(self, array: Any) -> Any:
        """`array`, shaped as `stored` (codes and scales alike when quantized), zero-padded to `info`'s shape."""
        if self.info == self.stored:
            return array
        return jax.tree.map(
            lambda a, info, stored: np.pad(np.asarray(a), [(0, n - s) for s, n in zip(stored.shape, info.shape)]),
            array,
            self.info,
            self.stored,
            is_leaf=is_info,
        )

    def unpadded(self, array: Any) -> Any:
        """`array`, shaped as `info`, without its padding: shaped as `stored`."""
        if self.info == self.stored:
            return array
        return jax.tree.map(
            lambda a, stored: a[tuple(slice(0, s) for s in stored.shape)], array, self.stored, is_leaf=is_info
        )


# Axes the devices hold padded (to a multiple of ModelConfig.vocab_multiple) that checkpoints store unpadded.
PADDED_AXES = ("vocab", "engram_rows")


def _stored(info: ArrayInfo | Quantized, cfg: ModelConfig, rows: int | None = None) -> ArrayInfo | Quantized:
    """A leaf's description as checkpoints store it: its vocabulary axes `cfg.vocab_size` long, its Engram rows axis
    `rows` long (codes and scales alike)."""
    real = {"vocab": cfg.vocab_size, "engram_rows": rows}

    def stored(part: ArrayInfo) -> ArrayInfo:
        if not any(axis in PADDED_AXES for axis in part.axes):
            return part
        shape = tuple(real[axis] or n if axis in PADDED_AXES else n for axis, n in zip(part.axes, part.shape))
        return dataclasses.replace(part, shape=shape)

    return map_infos(stored, info)


def _unstacked(info: Any) -> Any:
    """One layer's description of a stacked leaf: its leading `layers` axis dropped."""
    return map_infos(lambda i: ArrayInfo(i.shape[1:], i.dtype, i.axes[1:], i.init, i.memory), info)


def release_leaves(cfg: ModelConfig) -> list[LayerLeaf]:
    """Every leaf of the un-stacked model in its flatten order: embed, layer 0's leaves, ..., the last layer's,
    then the HC head, the final norm, the head and the drafter: MTP blocks (`mtp.N.attn.wq_a`, `mtp.N.e_proj`, ...)
    or the DSpark stages (`mtp.N.attn.wq_a`, ..., `mtp.0.main_proj`, `mtp.2.norm`, `mtp.2.markov_head.markov_w1`)."""
    segments = layer_segments(cfg)
    before: list[LayerLeaf] = []
    after: list[LayerLeaf] = []
    by_layer: dict[int, list[LayerLeaf]] = {}
    for path, info in flatten_with_names(abstract_weights(cfg), is_weight):
        if path in DERIVED_LEAVES:
            continue
        if path.startswith("mtp."):
            _, block, rest = path.split(".", 2)
            if rest.startswith("block."):  # the block's layer: named as the release names a layer's leaves
                own = _unstacked(info)
                after.append(LayerLeaf(f"mtp.{block}.{rest[len('block.') :]}", path, 0, own, _stored(own, cfg)))
            else:
                after.append(LayerLeaf(path, path, None, info, _stored(info, cfg)))
            continue
        if path.startswith("dspark."):
            after.extend(_dspark_leaves(path, info, cfg))
            continue
        if not path.startswith("segments."):
            (after if by_layer else before).append(LayerLeaf(path, path, None, info, _stored(info, cfg)))
            continue
        _, s, p, rest = path.split(".", 3)
        segment = segments[int(s)]
        own = _unstacked(info)
        for k in range(segment.repeats):
            layer = segment.layer(k, int(p))
            rows = _engram_rows(cfg, layer) if rest.startswith("engram.table") else None
            by_layer.setdefault(layer, []).append(
                LayerLeaf(f"layers.{layer}.{rest}", path, k, own, _stored(own, cfg, rows))
            )
    return before + [leaf for layer in sorted(by_layer) for leaf in by_layer[layer]] + after


def _engram_rows(cfg: ModelConfig, layer: int) -> int:
    """The rows of an Engram layer's table as the checkpoint stores them."""
    assert cfg.engram is not None  # only an Engram model has Engram tables
    return cfg.engram.num_embeddings[cfg.engram.layer_ids.index(layer)]


def _dspark_leaves(path: str, info: Any, cfg: ModelConfig) -> list[LayerLeaf]:
    """A DSpark drafter leaf as the release names it: a stage's layer leaf once per stage (`mtp.N.attn.wq_a`), the
    rest once."""
    assert cfg.dspark is not None  # the weights hold a drafter only when the config declares one
    last = cfg.dspark.stages - 1
    rest = path.removeprefix("dspark.")
    if rest.startswith("stages."):
        own = _unstacked(info)
        leaf = rest.removeprefix("stages.")
        return [LayerLeaf(f"mtp.{i}.{leaf}", path, i, own, _stored(own, cfg)) for i in range(cfg.dspark.stages)]
    head = rest.split(".", 1)[0]
    name = _DSPARK_NAMES[head].format(last=last) if head in _DSPARK_NAMES else f"mtp.{last}.{rest}"
    return [LayerLeaf(name, path, None, info, _stored(info, cfg))]


def layer_arrays(weights: Weights, cfg: ModelConfig) -> list[tuple[str, Any]]:
    """The weights un-stacked on the host, as checkpoints store them (the real vocabulary): (release name, array or
    Quantized of arrays) in `release_leaves` order."""
    host = {path: jax.tree.map(np.asarray, leaf) for path, leaf in flatten_with_names(weights, is_quantized)}
    return [
        (
            leaf.name,
            leaf.unpadded(
                host[leaf.path] if leaf.index is None else jax.tree.map(lambda a, i=leaf.index: a[i], host[leaf.path])
            ),
        )
        for leaf in release_leaves(cfg)
    ]


def is_quantized(x: Any) -> bool:
    """A whole quantized weight of a tree of values (its codes and scales are one leaf to a walk that asks this)."""
    return isinstance(x, Quantized)


# ---- random initialisation --------------------------------------------------------------------------------------


def init_weights(key: jax.Array, cfg: ModelConfig, std: float = 0.02) -> Weights:
    """Random weights of the right shapes (tests, benchmarks, the embedded default's generator). Each layer's
    leaves are drawn as the un-stacked model's were, so a seed gives the same values whatever the layer plan, and
    as checkpoints store them, so a padded vocabulary (cfg.vocab_multiple) only adds zero rows."""
    leaves = release_leaves(cfg)
    keys = jax.random.split(key, len(leaves))
    parts: dict[str, list[Any]] = {}
    for k, leaf in zip(keys, leaves):
        drawn = jax.tree.map(np.asarray, _init_leaf(k, leaf.stored, std, cfg))
        parts.setdefault(leaf.path, []).append(leaf.padded(drawn))
    stacked = {leaf.path for leaf in leaves if leaf.index is not None}
    abstract = abstract_weights(cfg)
    weights = [
        jax.tree.map(lambda *layers: jnp.asarray(np.stack(layers)), *parts[path])
        if path in stacked
        else jax.tree.map(jnp.asarray, parts[path][0])
        for path, _ in flatten_with_names(abstract, is_weight)
    ]
    return jax.tree.unflatten(jax.tree.structure(abstract, is_leaf=is_weight), weights)


def _init_leaf(key: jax.Array, info: ArrayInfo | Quantized, std: float, cfg: ModelConfig) -> Any:
    if isinstance(info, Quantized):  # drawn like the dense weight, then rounded as the release rounds it
        return quantize(std * jax.random.normal(key, info.shape, F32), info.format, info.blocks)
    if info.init == "ones":
        return jnp.ones(info.shape, info.dtype)
    if info.init == "zeros":
        return jnp.zeros(info.shape, info.dtype)
    if info.init == "small":
        return (0.5 * jax.random.normal(key, info.shape, F32)).astype(info.dtype)
    if info.init == "expert_ids":
        # Distinct experts per token, like a real tid2eid table: a random permutation prefix per row.
        noise = jax.random.uniform(key, (info.shape[0], cfg.n_routed_experts))
        return jnp.argsort(noise, axis=-1)[:, : info.shape[1]].astype(info.dtype)
    return (std * jax.random.normal(key, info.shape, F32)).astype(info.dtype)


def nbytes(info: Any, shape: tuple[int, ...] | None = None) -> int:
    """Bytes of an array description (anything with shape and dtype), or of a `shape` of it (a shard)."""
    return int(np.prod(info.shape if shape is None else shape)) * jnp.dtype(info.dtype).itemsize


def weights_nbytes(tree: Any) -> int:
    return sum(nbytes(x) for x in jax.tree.leaves(tree, is_leaf=is_info))
