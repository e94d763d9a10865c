"""The weights as registered-dataclass pytrees, described abstractly first.

`abstract_weights(cfg)` returns the same tree with an `ArrayInfo` at every leaf (shape, dtype, logical
axes, how to initialise). Initialisation, shardings and checkpoint restore targets are all derived from
it, so the three can never disagree. Projections are stored input-major (`x @ W`), the transpose of the
checkpoint's `[out, in]` layout.

The layers are stacked as the layer plan says (`jaxserve.model.segments`): `Weights.segments[s][p]` is one
`Layer` whose every leaf leads with a `layers` axis. Checkpoints name leaves per layer (`layers.3.attn.wq_b`);
`release_leaves` maps those names to their place in the stacks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import CSA, SWA, ModelConfig
from jaxserve.model.segments import LayerKind, layer_segments

F32 = jnp.float32


@dataclass(frozen=True)
class ArrayInfo:
    """A leaf of the abstract weights: what the array is, before it exists."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]  # logical axis names, mapped to mesh axes by jaxserve.sharding
    init: str = "normal"  # normal | ones | zeros | small | expert_ids

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


def _dataclass(cls):
    return jax.tree_util.register_dataclass(dataclass(cls))


@_dataclass
class HyperConnection:
    fn: Any  # [hc*d, (2+hc)*hc]: pre | post | comb (row-major hc x hc)
    base: Any  # [(2+hc)*hc]
    scale: Any  # [3]


@_dataclass
class Compressor:
    wkv: Any  # [d, coff*c]
    wgate: Any  # [d, coff*c]
    ape: Any  # [m, coff*c], per-slot position bias added to the gate
    norm: Any  # [c]


@_dataclass
class Indexer:
    compressor: Compressor
    wq_b: Any  # [q_lora, n_I, c_I]
    weights_proj: Any  # [d, n_I]


@_dataclass
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


@_dataclass
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


@_dataclass
class Layer:
    attn_hc: HyperConnection
    attn_norm: Any  # [d]
    attn: Attention
    ffn_hc: HyperConnection
    ffn_norm: Any  # [d]
    moe: MoE


@_dataclass
class Weights:
    embed: Any  # [V, d]
    segments: list[list[Layer]]  # [segment][position in its pattern], every leaf stacked: [repeats, ...]
    hc_head_fn: Any  # [hc*d, hc]
    hc_head_base: Any  # [hc]
    hc_head_scale: Any  # [1]
    norm: Any  # [d]
    head: Any  # [d, V]


# ---- the abstract description ---------------------------------------------------------------------------------

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
    return Compressor(
        wkv=ArrayInfo((d, coff * width), F32, ("embed", None)),
        wgate=ArrayInfo((d, coff * width), F32, ("embed", None)),
        ape=ArrayInfo((rate, coff * width), F32, (None, None), "small"),
        norm=ArrayInfo((width,), F32, (None,), "ones"),
    )


def _attention(cfg: ModelConfig, kind: str) -> Attention:
    dt = cfg.dtype
    d, h, hd, r = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    attn = Attention(
        wq_a=ArrayInfo((d, r), dt, ("embed", "q_lora")),
        q_norm=ArrayInfo((r,), F32, (None,), "ones"),
        wq_b=ArrayInfo((r, h, hd), dt, ("q_lora", "heads", "head_dim")),
        wkv=ArrayInfo((d, hd), dt, ("embed", "head_dim")),
        kv_norm=ArrayInfo((hd,), F32, (None,), "ones"),
        wo_a=ArrayInfo((h, hd, cfg.o_lora_rank), dt, ("heads", "head_dim", "o_lora")),
        wo_b=ArrayInfo((cfg.o_groups * cfg.o_lora_rank, d), dt, ("o_groups_lora", "embed")),
        sinks=ArrayInfo((h,), F32, ("heads",), "small"),
    )
    if kind == SWA:
        return attn
    if kind == CSA:
        indexer = Indexer(
            compressor=_compressor(cfg, cfg.csa_rate, cfg.index_head_dim, overlap=True),
            wq_b=ArrayInfo((r, cfg.index_n_heads, cfg.index_head_dim), dt, ("q_lora", "index_heads", None)),
            weights_proj=ArrayInfo((d, cfg.index_n_heads), F32, ("embed", "index_heads")),
        )
        return dataclasses.replace(attn, compressor=_compressor(cfg, cfg.csa_rate, hd, overlap=True),
                                   indexer=indexer)
    return dataclasses.replace(attn, compressor=_compressor(cfg, cfg.hca_rate, hd, overlap=False))


def _moe(cfg: ModelConfig, hashed: bool) -> MoE:
    dt = cfg.dtype
    d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    return MoE(
        router=ArrayInfo((d, e), F32, ("embed", None)),
        w_gate=ArrayInfo((e, d, f), dt, ("experts", "embed", "expert_ffw")),
        w_up=ArrayInfo((e, d, f), dt, ("experts", "embed", "expert_ffw")),
        w_down=ArrayInfo((e, f, d), dt, ("experts", "expert_ffw", "embed")),
        shared_gate=ArrayInfo((d, f), dt, ("embed", "ffw")),
        shared_up=ArrayInfo((d, f), dt, ("embed", "ffw")),
        shared_down=ArrayInfo((f, d), dt, ("ffw", "embed")),
        score_bias=None if hashed else ArrayInfo((e,), F32, (None,), "small"),
        tid2eid=ArrayInfo((cfg.vocab_size, cfg.num_experts_per_tok), jnp.int32, ("vocab", None), "expert_ids")
        if hashed else None,
    )


def _layer(cfg: ModelConfig, kind: LayerKind) -> Layer:
    d = cfg.hidden_size
    return Layer(
        attn_hc=_hyper_connection(cfg),
        attn_norm=ArrayInfo((d,), F32, (None,), "ones"),
        attn=_attention(cfg, kind.attention),
        ffn_hc=_hyper_connection(cfg),
        ffn_norm=ArrayInfo((d,), F32, (None,), "ones"),
        moe=_moe(cfg, kind.hashed),
    )


def stack_infos(tree: Any, repeats: int) -> Any:
    """An abstract (sub)tree with a leading `layers` axis of size `repeats` on every leaf."""
    return map_infos(lambda info: ArrayInfo((repeats, *info.shape), info.dtype, ("layers", *info.axes), info.init),
                     tree)


def abstract_weights(cfg: ModelConfig) -> Weights:
    d, n, v = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    return Weights(
        embed=ArrayInfo((v, d), cfg.dtype, ("vocab", "embed")),
        segments=[[stack_infos(_layer(cfg, kind), segment.repeats) for kind in segment.pattern]
                  for segment in layer_segments(cfg)],
        hc_head_fn=ArrayInfo((n * d, n), F32, ("hc_embed", None)),
        hc_head_base=ArrayInfo((n,), F32, (None,), "small"),
        hc_head_scale=ArrayInfo((1,), F32, (None,), "ones"),
        norm=ArrayInfo((d,), F32, (None,), "ones"),
        head=ArrayInfo((d, v), cfg.dtype, ("embed", "vocab")),
    )


def is_info(x: Any) -> bool:
    return isinstance(x, ArrayInfo)


def map_infos(fn: Callable[[ArrayInfo], Any], tree: Any) -> Any:
    return jax.tree.map(fn, tree, is_leaf=is_info)


def flatten_with_names(tree: Any) -> list[tuple[str, Any]]:
    """(dotted path, leaf) pairs, e.g. ('segments.2.1.attn.wq_b', ...), in flatten order."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_info)
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
    info: ArrayInfo  # its own shape (no layers axis), dtype, logical axes


def release_leaves(cfg: ModelConfig) -> list[LayerLeaf]:
    """Every leaf of the un-stacked model in its flatten order: embed, layer 0's leaves, ..., the last layer's,
    then the HC head, the final norm and the head."""
    segments = layer_segments(cfg)
    before: list[LayerLeaf] = []
    after: list[LayerLeaf] = []
    by_layer: dict[int, list[LayerLeaf]] = {}
    for path, info in flatten_with_names(abstract_weights(cfg)):
        if not path.startswith("segments."):
            (after if by_layer else before).append(LayerLeaf(path, path, None, info))
            continue
        _, s, p, rest = path.split(".", 3)
        segment = segments[int(s)]
        own = ArrayInfo(info.shape[1:], info.dtype, info.axes[1:], info.init)
        for k in range(segment.repeats):
            layer = segment.layer(k, int(p))
            by_layer.setdefault(layer, []).append(LayerLeaf(f"layers.{layer}.{rest}", path, k, own))
    return before + [leaf for layer in sorted(by_layer) for leaf in by_layer[layer]] + after


def layer_arrays(weights: Weights, cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """The weights un-stacked on the host: (release name, array) in `release_leaves` order."""
    host = {path: np.asarray(leaf) for path, leaf in flatten_with_names(weights)}
    return [(leaf.name, host[leaf.path] if leaf.index is None else host[leaf.path][leaf.index])
            for leaf in release_leaves(cfg)]


# ---- random initialisation --------------------------------------------------------------------------------------

def init_weights(key: jax.Array, cfg: ModelConfig, std: float = 0.02) -> Weights:
    """Random weights of the right shapes (tests, benchmarks, the embedded default's generator). Each layer's
    leaves are drawn as the un-stacked model's were, so a seed gives the same values whatever the layer plan."""
    leaves = release_leaves(cfg)
    keys = jax.random.split(key, len(leaves))
    parts: dict[str, list[np.ndarray]] = {}
    for k, leaf in zip(keys, leaves):
        parts.setdefault(leaf.path, []).append(np.asarray(_init_leaf(k, leaf.info, std, cfg)))
    stacked = {leaf.path for leaf in leaves if leaf.index is not None}
    abstract = abstract_weights(cfg)
    arrays = [jnp.asarray(np.stack(parts[path]) if path in stacked else parts[path][0])
              for path, _ in flatten_with_names(abstract)]
    return jax.tree.unflatten(jax.tree.structure(abstract, is_leaf=is_info), arrays)


def _init_leaf(key: jax.Array, info: ArrayInfo, std: float, cfg: ModelConfig) -> jax.Array:
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


def weights_nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree, is_leaf=is_info))
