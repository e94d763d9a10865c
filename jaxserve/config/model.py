"""Model configuration: parsed from a checkpoint's config.json (model_type deepseek_v4, or deepseek_v41 with its
CSA2 schedule and Engram memory), plus presets.

One frozen, hashable dataclass, so it can be a static argument of jitted functions. Per-request
values never live here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jaxserve.config.flags import ConfigError
from jaxserve.kernels.quant import FP4, FP8

SWA, CSA, HCA = "swa", "csa", "hca"
# DeepSeek-V4.1's compressed layers (CSA2): a window plus top-k entries of a compressed KV shared by a group of layers.
CSA2 = "csa2"
# HF layer_types names and the legacy compress_ratios values, mapped to our layer kinds.
_HF_LAYER_TYPES = {
    "sliding_attention": SWA,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
_LEGACY_RATIO_KINDS = {0: SWA, 4: CSA, 128: HCA}
SUPPORTED_DTYPES = ("bfloat16", "float32")
# --quantization: `auto` keeps the weights in the formats the checkpoint ships (FP8 / FP4 codes and their scales on
# the devices), `none` dequantizes them to --dtype at load.
QUANTIZATION_MODES = ("auto", "none")
FP8_WEIGHT_BLOCK = [128, 128]  # DeepSeek-V4's quantization_config.weight_block_size
V41_FP8_WEIGHT_BLOCK = [32, 32]  # DeepSeek-V4.1's
_EXPERT_DTYPES = {"fp4": FP4, "fp8": FP8}


@jax.tree_util.register_static
@dataclass(frozen=True)
class YarnConfig:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


DSPARK_STAGES = 3  # the release's drafter: three decoder layers (vLLM's default n_mtp_layers)


@jax.tree_util.register_static
@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark block drafter that DeepSeek-V4-Flash-0731 and -Pro-0813 ship in place of the MTP block (config.json's
    `dspark_*` keys): a block of `block_size` tokens drafted at once, its query the last accepted token and copies of
    `noise_token_id`, from the target's hidden states at `target_layer_ids`, with a Markov head of rank
    `markov_rank`; `stages` decoder layers (the release's three; compress_ratios' entries past the backbone's count
    them)."""

    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    stages: int = DSPARK_STAGES


@jax.tree_util.register_static
@dataclass(frozen=True)
class SharedKVConfig:
    """DeepSeek-V4.1's CSA2 schedule (config.json's `compress_ratios`, `kv_source_layer_ids`,
    `index_source_layer_ids`, `candidate_*`): per layer its compress ratio (0: window only; 1: one entry a token;
    r > 1: r tokens pooled into one); the KV sources own a compressor and publish the compressed entries and indexer
    keys every later compressed layer up to the next source reads; the index sources score those keys and publish
    the top-k picks the layers after them reuse; the candidate source's best `candidate_topk_blocks` blocks of
    `candidate_block_size` entries bound every later index source's picks (the two-level top-k; -1: none)."""

    ratios: tuple[int, ...]
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int
    candidate_topk_blocks: int
    candidate_block_size: int

    def source_of(self, layer: int) -> int:
        """The KV source whose entries a compressed layer reads: the last one at or before it."""
        return max(s for s in self.kv_sources if s <= layer)

    def index_source_of(self, layer: int) -> int:
        """The index source whose picks a compressed layer attends to: the last one at or before it."""
        return max(s for s in self.index_sources if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        return 0 <= self.candidate_source < layer and layer in self.index_sources


# Tokens before its first that a step's row carries (jaxserve.request.batch): an Engram hashes n-grams of at most one
# more token.
ENGRAM_CONTEXT_TOKENS = 7


@jax.tree_util.register_static
@dataclass(frozen=True)
class EngramConfig:
    """DeepSeek-V4.1's Engram memory (config.json's `engram_*`): at `layer_ids`, each position's n-grams (2 to
    `max_ngram` tokens ending there, over the tokenizer's compressed vocabulary of `compressed_vocab_size` ids)
    hashed by `n_heads` heads each into prime-sized buckets drawn above `vocab_size`, rows of `head_dim` gathered from
    a table of `num_embeddings[i]` rows and gated into the streams. `pad_id`: the token id that fills n-gram slots
    before the sequence's start."""

    layer_ids: tuple[int, ...]
    vocab_size: int
    num_embeddings: tuple[int, ...]
    max_ngram: int
    n_heads: int
    head_dim: int
    pad_id: int
    compressed_vocab_size: int

    @property
    def columns(self) -> int:
        """Table rows a position gathers per Engram layer: one per (n-gram size, head)."""
        return (self.max_ngram - 1) * self.n_heads


@jax.tree_util.register_static
@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_kinds: tuple[str, ...]  # per layer: "swa" | "csa" | "hca"
    hash_layers: tuple[bool, ...]  # per layer: route by the tid2eid table instead of top-k
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnConfig | None
    max_position_embeddings: int
    bos_token_id: int = 0
    eos_token_id: int = 1
    dtype: str = "bfloat16"  # weights and activations; HC, router, compressor and softmax maths stay float32
    # How the weights are kept on the devices (jaxserve.kernels.quant formats; None: dense in `dtype`): the
    # attention and shared-expert projections, and the routed experts. From config.json's quantization_config and
    # expert_dtype, i.e. what the release ships; `dequantized()` for --quantization none.
    linear_format: str | None = None
    expert_format: str | None = None
    # The devices hold the vocabulary (the embedding, the LM head, the hash-routing tables) padded with zero rows to
    # a multiple of this: the ways the mesh splits it (`sharding.for_mesh`), so any tensor-parallel size holds any
    # vocabulary. Not in config.json; the API, the tokenizer and token-id checks see `vocab_size`, and no padded id
    # is ever sampled or shown (`forward.vocab_logits`).
    vocab_multiple: int = 1
    # The next-token-prediction (MTP) blocks the checkpoint declares (config.json's num_nextn_predict_layers), and
    # how many of them the engine holds: none unless something drafts with them (`with_mtp`), since a Flash MTP
    # block is a whole MoE layer's weights.
    nextn_layers: int = 0
    mtp_layers: int = 0
    # The DSpark drafter the checkpoint ships instead of MTP blocks (V4 0731 and 0813; None: V4's MTP blocks, if any):
    # its tensors (`mtp.*`, the Markov and confidence heads) are a different block, which MTP cannot run. The engine
    # holds it only to draft with it (`with_drafter("dspark")`).
    dspark: DSparkConfig | None = None
    dspark_drafting: bool = False
    # DeepSeek-V4.1 (model_type deepseek_v41): its CSA2 schedule (None: DeepSeek-V4) and its Engram memory (None:
    # none). A V4.1 model has no per-head query norm, no HC head (its mHC is single-pass: each site collapses the
    # streams with the weights the site before it computed) and fake-quantizes its KV as it was trained to.
    shared_kv: SharedKVConfig | None = None
    engram: EngramConfig | None = None
    # FP8 weights' block (quantization_config.weight_block_size): 128 x 128 in V4, 32 x 32 in V4.1.
    fp8_block: int = 128
    image_token_id: int | None = None  # V4.1's image placeholder; jaxserve serves its text model only
    engram_on_host: bool = False  # the Engram tables in host memory (--engram-placement host)

    def __post_init__(self):
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.o_groups

    def compress_rate(self, layer: int) -> int:
        if self.shared_kv is not None:
            return self.shared_kv.ratios[layer]
        return self.kind_rate(self.layer_kinds[layer])

    def kind_rate(self, kind: str) -> int:
        """Tokens per compressed entry of a DeepSeek-V4 attention kind (0: SWA compresses nothing)."""
        return {SWA: 0, CSA: self.csa_rate, HCA: self.hca_rate}[kind]

    @property
    def v41(self) -> bool:
        return self.shared_kv is not None

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k != SWA)

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary rows the devices hold: `vocab_size` rounded up to a multiple of `vocab_multiple`."""
        return self.padded_rows(self.vocab_size)

    def padded_rows(self, rows: int) -> int:
        """Rows of an axis split like the vocabulary (V4.1's Engram tables too) that the devices hold: `rows` rounded
        up to a multiple of `vocab_multiple`."""
        return -(-rows // self.vocab_multiple) * self.vocab_multiple

    def with_vocab_multiple(self, multiple: int) -> ModelConfig:
        return dataclasses.replace(self, vocab_multiple=multiple)

    def with_engram_placement(self, placement: str) -> ModelConfig:
        """Where the Engram tables live: "device" or "host" (EngineConfig.engram_placement)."""
        return dataclasses.replace(self, engram_on_host=placement == "host")

    def with_dtype(self, dtype: str) -> ModelConfig:
        return dataclasses.replace(self, dtype=dtype)

    def with_drafter(self, method: str | None) -> ModelConfig:
        """`cfg` holding the drafter that speculative decoding's `method` drafts with ("mtp": the first MTP block;
        "dspark": the DSpark drafter; None: none). ConfigError when the checkpoint ships no such drafter."""
        if method is not None and self.v41:
            raise ConfigError(
                f"speculative_config.method={method!r}: speculative decoding of DeepSeek-V4.1 is not built yet (its "
                "DSpark stages are skipped at load); serve it without --speculative-config"
            )
        if method == "dspark":
            if self.dspark is None:
                raise ConfigError(
                    "speculative_config.method='dspark': the checkpoint ships no DSpark drafter (no dspark_* keys in "
                    "its config.json, no dspark/ drafter folder beside it)"
                    f"{'; it has MTP blocks: use method mtp' if self.nextn_layers else ''}"
                )
            return dataclasses.replace(self, dspark_drafting=True)
        return self.with_mtp(1 if method == "mtp" else 0)

    def with_mtp(self, layers: int) -> ModelConfig:
        """`cfg` holding its first `layers` MTP blocks (ConfigError when the checkpoint declares fewer, or ships a
        DSpark drafter instead)."""
        if layers and self.dspark is not None:
            raise ConfigError(
                f"dspark_block_size={self.dspark.block_size}: the checkpoint ships a DSpark drafter (as "
                "DeepSeek-V4-Flash-0731 and -Pro-0813 do), not MTP blocks (its mtp.* tensors have no enorm, hnorm, "
                "e_proj or h_proj), so MTP cannot draft with it; draft with "
                '--speculative-config \'{"method": "dspark", "num_speculative_tokens": 5}\' instead'
            )
        if not 0 <= layers <= self.nextn_layers:
            raise ConfigError(
                f"num_nextn_predict_layers={self.nextn_layers}: the checkpoint has {self.nextn_layers} MTP blocks, "
                f"{layers} were asked for (speculative decoding drafts with them)"
            )
        return dataclasses.replace(self, mtp_layers=layers)

    def dequantized(self) -> ModelConfig:
        """Every weight dense in `dtype` (what --quantization none loads)."""
        return dataclasses.replace(self, linear_format=None, expert_format=None)

    def with_quantization(self, quantization: str) -> ModelConfig:
        """`auto` keeps the formats the release ships; `none` dequantizes (see QUANTIZATION_MODES)."""
        if quantization not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization={quantization!r}: must be one of {QUANTIZATION_MODES}")
        return self if quantization == "auto" else self.dequantized()

    @property
    def quantized(self) -> bool:
        return self.linear_format is not None or self.expert_format is not None

    # ---- validation ------------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, field: str, value: Any, why: str) -> None:
            if not cond:
                raise ConfigError(f"{field}={value!r}: {why}")

        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "sliding_window",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "hc_mult",
            "hc_sinkhorn_iters",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "max_position_embeddings",
            "vocab_multiple",
        ):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, name, value, "must be a positive integer")
        need(self.nextn_layers >= 0, "num_nextn_predict_layers", self.nextn_layers, "must be >= 0")
        need(
            0 <= self.mtp_layers <= self.nextn_layers,
            "mtp_layers",
            self.mtp_layers,
            f"must be in [0, num_nextn_predict_layers={self.nextn_layers}]",
        )
        if self.dspark is not None:
            draft = self.dspark
            need(draft.block_size >= 2, "dspark_block_size", draft.block_size, "must be >= 2")
            need(
                0 <= draft.noise_token_id < self.vocab_size,
                "dspark_noise_token_id",
                draft.noise_token_id,
                f"must be a token id below vocab_size={self.vocab_size}",
            )
            need(
                bool(draft.target_layer_ids)
                and len(set(draft.target_layer_ids)) == len(draft.target_layer_ids)
                and all(0 <= i < self.num_layers for i in draft.target_layer_ids),
                "dspark_target_layer_ids",
                list(draft.target_layer_ids),
                f"must be distinct layer indices below num_hidden_layers={self.num_layers}",
            )
            need(draft.markov_rank > 0, "dspark_markov_rank", draft.markov_rank, "must be a positive integer")
            need(draft.stages > 0, "DSpark stages", draft.stages, "must be a positive integer")
        need(
            not self.dspark_drafting or self.dspark is not None,
            "dspark_drafting",
            self.dspark_drafting,
            "needs a DSpark drafter (dspark_* keys)",
        )
        need(self.dtype in SUPPORTED_DTYPES, "dtype", self.dtype, f"must be one of {SUPPORTED_DTYPES}")
        need(
            self.linear_format in (None, FP8),
            "quantization_config",
            self.linear_format,
            f"the projections can be kept as {FP8} or dense",
        )
        need(
            self.expert_format in (None, FP8, FP4),
            "expert_dtype",
            self.expert_format,
            f"routed experts can be kept as {FP8}, {FP4} or dense",
        )
        need(
            (self.linear_format is None) == (self.expert_format is None),
            "expert_dtype",
            self.expert_format,
            f"a release quantizes both the projections and the experts or neither (projections: {self.linear_format})",
        )
        need(
            len(self.layer_kinds) == self.num_layers,
            "layer_types",
            list(self.layer_kinds),
            f"needs one entry per layer (num_hidden_layers={self.num_layers})",
        )
        kinds = (SWA, CSA2) if self.v41 else (SWA, CSA, HCA)
        bad = [k for k in self.layer_kinds if k not in kinds]
        need(not bad, "layer_types", bad, "unknown layer kind")
        if self.shared_kv is not None:
            self._validate_shared_kv(self.shared_kv, need)
        if self.engram is not None:
            self._validate_engram(self.engram, need)
        need(self.fp8_block > 0, "quantization_config.weight_block_size", self.fp8_block, "must be positive")
        need(
            len(self.hash_layers) == self.num_layers,
            "mlp_layer_types",
            list(self.hash_layers),
            f"needs one entry per layer (num_hidden_layers={self.num_layers})",
        )
        need(
            self.num_heads % self.o_groups == 0,
            "o_groups",
            self.o_groups,
            f"must divide num_attention_heads={self.num_heads}",
        )
        need(
            0 < self.rope_head_dim <= self.head_dim and self.rope_head_dim % 2 == 0,
            "qk_rope_head_dim",
            self.rope_head_dim,
            f"must be even and in (0, head_dim={self.head_dim}]",
        )
        need(
            self.index_head_dim >= self.rope_head_dim,
            "index_head_dim",
            self.index_head_dim,
            f"must be >= qk_rope_head_dim={self.rope_head_dim}",
        )
        need(
            self.num_experts_per_tok <= self.n_routed_experts,
            "num_experts_per_tok",
            self.num_experts_per_tok,
            f"must be <= n_routed_experts={self.n_routed_experts}",
        )
        # CSA is always the overlapped kind (pooling width 2m, stride m); that needs m >= 1 and HCA must not overlap.
        need(self.csa_rate >= 2, "compress_rates.compressed_sparse_attention", self.csa_rate, "must be >= 2")
        need(
            self.hca_rate >= 2 and self.hca_rate != self.csa_rate,
            "compress_rates.heavily_compressed_attention",
            self.hca_rate,
            f"must be >= 2 and differ from the CSA rate {self.csa_rate}",
        )

    def _validate_shared_kv(self, kv: SharedKVConfig, need: Callable[[bool, str, Any, str], None]) -> None:
        """CSA2's schedule rules, as DeepSeek-V4.1's reference config states them."""
        n = self.num_layers
        need(len(kv.ratios) == n, "compress_ratios", list(kv.ratios), f"needs one entry per layer ({n})")
        need(all(r >= 0 for r in kv.ratios), "compress_ratios", list(kv.ratios), "entries must be >= 0")
        compressed = [i for i in range(n) if kv.ratios[i] > 0]
        need(
            all(0 <= i < n and kv.ratios[i] > 0 for i in kv.kv_sources),
            "kv_source_layer_ids",
            list(kv.kv_sources),
            "must be compressed layers (compress_ratios[i] > 0)",
        )
        need(
            all(any(s <= i for s in kv.kv_sources) for i in compressed),
            "kv_source_layer_ids",
            list(kv.kv_sources),
            "every compressed layer needs a KV source at or before it",
        )
        need(
            all(kv.ratios[i] > 0 and any(s <= i for s in kv.kv_sources) for i in kv.index_sources),
            "index_source_layer_ids",
            list(kv.index_sources),
            "must be compressed layers with a KV source at or before them",
        )
        need(
            all(any(s <= i for s in kv.index_sources) for i in compressed),
            "index_source_layer_ids",
            list(kv.index_sources),
            "every compressed layer needs an index source at or before it (its top-k picks)",
        )
        need(
            all(kv.ratios[i] == kv.ratios[kv.source_of(i)] for i in compressed),
            "compress_ratios",
            list(kv.ratios),
            "a layer must have its KV source's ratio (it reads that source's entries)",
        )
        if kv.candidate_source >= 0:
            need(
                kv.candidate_source in kv.index_sources,
                "candidate_source_layer_id",
                kv.candidate_source,
                f"must be an index source ({list(kv.index_sources)})",
            )
            later = [i for i in kv.index_sources if kv.uses_candidates(i)]
            need(
                all(kv.source_of(i) == kv.source_of(kv.candidate_source) for i in later),
                "candidate_source_layer_id",
                kv.candidate_source,
                "the index sources after it must read the same KV source (its candidate blocks index those entries)",
            )
            need(kv.candidate_topk_blocks > 0, "candidate_topk_blocks", kv.candidate_topk_blocks, "must be positive")
            need(kv.candidate_block_size > 0, "candidate_block_size", kv.candidate_block_size, "must be positive")

    def _validate_engram(self, engram: EngramConfig, need: Callable[[bool, str, Any, str], None]) -> None:
        need(
            len(set(engram.layer_ids)) == len(engram.layer_ids)
            and all(0 <= i < self.num_layers for i in engram.layer_ids),
            "engram_layer_ids",
            list(engram.layer_ids),
            f"must be distinct layers below num_hidden_layers={self.num_layers}",
        )
        need(
            len(engram.num_embeddings) == len(engram.layer_ids),
            "engram_num_embeddings",
            list(engram.num_embeddings),
            "needs one entry per Engram layer",
        )
        for name in ("vocab_size", "max_ngram", "n_heads", "head_dim", "compressed_vocab_size"):
            value = getattr(engram, name)
            need(isinstance(value, int) and value > 0, f"engram_{name}", value, "must be a positive integer")
        need(
            2 <= engram.max_ngram <= ENGRAM_CONTEXT_TOKENS + 1,
            "engram_max_ngram_size",
            engram.max_ngram,
            f"must be in [2, {ENGRAM_CONTEXT_TOKENS + 1}] (n-grams jaxserve hashes)",
        )
        need(0 <= engram.pad_id < self.vocab_size, "engram_pad_id", engram.pad_id, "must be a token id")


# ---- parsing config.json ------------------------------------------------------------------------------------------


def _layer_kinds(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    if raw.get("layer_types") is not None:
        types = list(raw["layer_types"])[:n]
        bad = [t for t in types if t not in _HF_LAYER_TYPES]
        if bad:
            raise ConfigError(f"layer_types={bad!r}: entries must be one of {sorted(_HF_LAYER_TYPES)}")
        return tuple(_HF_LAYER_TYPES[t] for t in types)
    if raw.get("compress_ratios") is not None:
        ratios = list(raw["compress_ratios"])
        bad = [r for r in ratios if r not in _LEGACY_RATIO_KINDS]
        if bad:
            raise ConfigError(
                f"compress_ratios contains {bad!r}: the legacy key accepts only 0, 4 and 128 "
                "(use layer_types with compress_rates for other ratios)"
            )
        if len(ratios) < n:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries, fewer than num_hidden_layers={n}")
        return tuple(_LEGACY_RATIO_KINDS[r] for r in ratios[:n])  # a trailing extra entry belongs to the MTP block
    raise ConfigError("layer_types: missing (neither layer_types nor the legacy compress_ratios is present)")


def _hash_layers(raw: dict[str, Any], n: int) -> tuple[bool, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = list(raw["mlp_layer_types"])[:n]
        bad = [t for t in types if t not in ("hash_moe", "moe")]
        if bad:
            raise ConfigError(f"mlp_layer_types={bad!r}: entries must be 'hash_moe' or 'moe'")
        return tuple(t == "hash_moe" for t in types)
    n_hash = raw.get("num_hash_layers", 3)
    if not isinstance(n_hash, int) or n_hash < 0:
        raise ConfigError(f"num_hash_layers={n_hash!r}: must be a non-negative integer")
    return tuple(i < n_hash for i in range(n))


def _yarn(raw: dict[str, Any]) -> YarnConfig | None:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        scaling = params["compress"]
    else:
        scaling = raw.get("rope_scaling") or (params if isinstance(params, dict) else None)
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.type={kind!r}: only 'yarn' (or none) is supported for DeepSeek-V4")
    if "attention_factor" in scaling and float(scaling["attention_factor"]) != 1.0:
        raise ConfigError(
            f"rope_parameters.compress.attention_factor={scaling['attention_factor']!r}: "
            "DeepSeek-V4 uses no YaRN mscale (must be 1.0)"
        )
    return YarnConfig(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
    )


def _rope_head_dim(raw: dict[str, Any]) -> int:
    head_dim = raw.get("head_dim", 512)
    if raw.get("qk_rope_head_dim") is not None:
        return int(raw["qk_rope_head_dim"])
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        return 64
    return int(head_dim * factor)


def _main_rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict):
        return float(params["main"].get("rope_theta", raw.get("rope_theta", 10000.0)))
    return float(raw.get("rope_theta", 10000.0))


def _compress_rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        return float(params["compress"].get("rope_theta", raw.get("compress_rope_theta", 160000.0)))
    return float(raw.get("compress_rope_theta", 160000.0))


def _single_id(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, list):
        value = value[0]
    return default if value is None else int(value)


def _weight_formats(raw: dict[str, Any], block: list[int] = FP8_WEIGHT_BLOCK) -> tuple[str | None, str | None]:
    """(projections, routed experts) storage formats from quantization_config and expert_dtype; dense without a
    quantization_config. `block`: the FP8 blocks the model's release uses."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None, None
    expected = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": block}
    for key, value in expected.items():
        if quant.get(key, value) != value:
            raise ConfigError(
                f"quantization_config.{key}={quant[key]!r}: jaxserve reads DeepSeek's FP8 release "
                f"format ({key}={value!r})"
            )
    expert = raw.get("expert_dtype", "fp8")
    if expert not in _EXPERT_DTYPES:
        raise ConfigError(f"expert_dtype={expert!r}: must be one of {sorted(_EXPERT_DTYPES)}")
    return FP8, _EXPERT_DTYPES[expert]


def _dspark(raw: dict[str, Any]) -> DSparkConfig | None:
    """The DSpark drafter's keys (all four, or none: V4's MTP). Its stages: `n_mtp_layers` (DeepSeek's inference
    config's key, which jaxserve writes), else the compress_ratios entries past the backbone's layers where the
    release's HF config writes them (three zeros), else the release's three."""
    keys = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")
    present = [key for key in keys if raw.get(key) is not None]
    if not present:
        return None
    if len(present) < len(keys):
        raise ConfigError(f"{sorted(set(keys) - set(present))}: missing beside {present} (a DSpark drafter has all)")
    extra = max(0, len(raw.get("compress_ratios") or ()) - int(raw["num_hidden_layers"]))
    stages = raw.get("n_mtp_layers")
    if stages is not None and extra and int(stages) != extra:
        raise ConfigError(
            f"n_mtp_layers={stages}, but compress_ratios has {extra} entries past num_hidden_layers (one a DSpark "
            "stage): they must agree"
        )
    return DSparkConfig(
        block_size=int(raw["dspark_block_size"]),
        noise_token_id=int(raw["dspark_noise_token_id"]),
        target_layer_ids=tuple(int(i) for i in raw["dspark_target_layer_ids"]),
        markov_rank=int(raw["dspark_markov_rank"]),
        stages=int(stages) if stages is not None else extra or DSPARK_STAGES,
    )


V41_MODEL_TYPE = "deepseek_v41"
_V41_TOP_LEVEL = ("quantization_config", "expert_dtype", "image_token_id", "tie_word_embeddings")


def _v41_text(raw: dict[str, Any]) -> dict[str, Any]:
    """A DeepSeek-V4.1 config.json's text model: its `text_config` (the release's composite form) with the top-level
    keys that describe it, or the text config itself."""
    if raw.get("model_type") == V41_MODEL_TYPE and isinstance(raw.get("text_config"), dict):
        text = dict(raw["text_config"])
        text.update({key: raw[key] for key in _V41_TOP_LEVEL if key in raw})
        return text
    return dict(raw)


def _shared_kv(raw: dict[str, Any], n: int) -> SharedKVConfig:
    ratios = raw.get("compress_ratios")
    if ratios is None:
        raise ConfigError("compress_ratios: required for DeepSeek-V4.1 (the CSA2 schedule)")
    ratios = tuple(int(r) for r in ratios)
    if len(ratios) < n:
        raise ConfigError(f"compress_ratios has {len(ratios)} entries, fewer than num_hidden_layers={n}")
    ratios = ratios[:n]  # the entries past the backbone's are the DSpark stages' (window only)
    kv_sources = raw.get("kv_source_layer_ids")
    if kv_sources is None:  # the reference's rule: the first layer of each run of one ratio
        kv_sources = [i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i])]
    index_sources = raw.get("index_source_layer_ids")
    if index_sources is None:
        index_sources = kv_sources
    candidate = raw.get("candidate_source_layer_id")
    if candidate is None:
        candidate = kv_sources[-1] if kv_sources else -1
    return SharedKVConfig(
        ratios=ratios,
        kv_sources=tuple(int(i) for i in kv_sources),
        index_sources=tuple(int(i) for i in index_sources),
        candidate_source=int(candidate),
        candidate_topk_blocks=int(raw.get("candidate_topk_blocks", 2048)),
        candidate_block_size=int(raw.get("candidate_block_size", 8)),
    )


def _engram(raw: dict[str, Any]) -> EngramConfig | None:
    layers = list(raw.get("engram_layer_ids") or [])
    if not layers:
        return None
    if raw.get("engram_num_embeddings") is None:
        raise ConfigError("engram_num_embeddings: required beside engram_layer_ids (the tables' rows)")
    return EngramConfig(
        layer_ids=tuple(int(i) for i in layers),
        vocab_size=int(raw.get("engram_vocab_size", 16000000)),
        num_embeddings=tuple(int(r) for r in raw["engram_num_embeddings"]),
        max_ngram=int(raw.get("engram_max_ngram_size", 4)),
        n_heads=int(raw.get("engram_n_heads", 8)),
        head_dim=int(raw.get("engram_head_dim", 256)),
        pad_id=int(raw.get("engram_pad_id", 2)),
        compressed_vocab_size=int(raw.get("engram_compressed_vocab_size", 99092)),
    )


def _v41_fields(raw: dict[str, Any], n: int) -> dict[str, Any]:
    """The ModelConfig fields a DeepSeek-V4.1 text config sets its own way."""
    for key, supported in (("gate_temp", 1.0), ("topk_method", "noaux_tc"), ("norm_topk_prob", True)):
        if raw.get(key, supported) != supported:
            raise ConfigError(f"{key}={raw[key]!r}: jaxserve serves DeepSeek-V4.1 with {key}={supported!r}")
    shared_kv = _shared_kv(raw, n)
    block = (raw.get("quantization_config") or {}).get("weight_block_size", V41_FP8_WEIGHT_BLOCK)
    image = raw.get("image_token_id")
    return dict(
        layer_kinds=tuple(CSA2 if r else SWA for r in shared_kv.ratios),
        hash_layers=(False,) * n,
        shared_kv=shared_kv,
        engram=_engram(raw),
        fp8_block=int(block[0]) if isinstance(block, list) and block else 0,
        image_token_id=None if image is None else int(image),
        # The DSpark stages V4.1 ships are not read yet (ModelConfig.with_drafter says so when asked to draft).
        nextn_layers=0,
        dspark=None,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-20)),
    )


def config_from_dict(raw: dict[str, Any], dtype: str = "bfloat16") -> ModelConfig:
    """Parse a DeepSeek-V4 config.json dict, accepting the legacy and the current HF key sets, or a DeepSeek-V4.1
    one (the release's composite form, or its text config)."""
    model_type = raw.get("model_type")
    if model_type not in ("deepseek_v4", V41_MODEL_TYPE, f"{V41_MODEL_TYPE}_text"):
        raise ConfigError(f"model_type={model_type!r}: jaxserve serves 'deepseek_v4' and 'deepseek_v41'")
    v41 = model_type != "deepseek_v4"
    if v41:
        raw = _v41_text(raw)
    if raw.get("num_key_value_heads", 1) != 1:
        raise ConfigError(f"num_key_value_heads={raw['num_key_value_heads']!r}: DeepSeek-V4 has one shared K=V head")
    if raw.get("tie_word_embeddings", False):
        raise ConfigError("tie_word_embeddings=True: DeepSeek-V4 has an untied head")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ConfigError(f"scoring_func={scoring!r}: only 'sqrtsoftplus' is supported")
    if raw.get("n_shared_experts", 1) != 1:
        raise ConfigError(f"n_shared_experts={raw['n_shared_experts']!r}: DeepSeek-V4 has exactly one shared expert")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={raw['hidden_act']!r}: only 'silu' is supported")
    try:
        n = int(raw["num_hidden_layers"])
        rates = dict(raw.get("compress_rates") or {})
        if v41:
            own = _v41_fields(raw, n)
            block = [own["fp8_block"]] * 2
        else:
            own = dict(layer_kinds=_layer_kinds(raw, n), hash_layers=_hash_layers(raw, n))
            own |= dict(nextn_layers=int(raw.get("num_nextn_predict_layers") or 0), dspark=_dspark(raw))
            block = FP8_WEIGHT_BLOCK
        linear_format, expert_format = _weight_formats(raw, block)
        fields: dict[str, Any] = dict(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=n,
            num_heads=int(raw["num_attention_heads"]),
            head_dim=int(raw.get("head_dim", 512)),
            rope_head_dim=_rope_head_dim(raw),
            q_lora_rank=int(raw["q_lora_rank"]),
            o_groups=int(raw["o_groups"]),
            o_lora_rank=int(raw["o_lora_rank"]),
            sliding_window=int(raw.get("sliding_window", 128)),
            csa_rate=int(rates.get("compressed_sparse_attention", raw.get("compress_rate_csa", 4))),
            hca_rate=int(rates.get("heavily_compressed_attention", raw.get("compress_rate_hca", 128))),
            index_n_heads=int(raw.get("index_n_heads", 64)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            index_topk=int(raw.get("index_topk", 512)),
            n_routed_experts=int(raw["n_routed_experts"]),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
            hc_mult=int(raw.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_main_rope_theta(raw),
            compress_rope_theta=_compress_rope_theta(raw),
            yarn=_yarn(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
            bos_token_id=_single_id(raw, "bos_token_id", 0),
            eos_token_id=_single_id(raw, "eos_token_id", 1),
            dtype=dtype,
            linear_format=linear_format,
            expert_format=expert_format,
        )
        return ModelConfig(**(fields | own))
    except KeyError as missing:
        raise ConfigError(f"{missing.args[0]}: required field missing from config.json") from None
    except (TypeError, ValueError) as bad:
        if isinstance(bad, ConfigError):
            raise
        raise ConfigError(f"config.json has a field of the wrong type: {bad}") from None


def load_config(path: str | Path, dtype: str = "bfloat16") -> ModelConfig:
    """Read `config.json` from a checkpoint folder (or the file itself); every error names the file."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such checkpoint folder")
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"{file}: not found (the folder has no config.json, so it is not a DeepSeek-V4 checkpoint)")
    try:
        return config_from_dict(json.loads(file.read_text()), dtype=dtype)
    except json.JSONDecodeError as bad:
        raise ConfigError(f"{file}: not valid JSON ({bad})") from None
    except ConfigError as bad:
        raise ConfigError(f"{file}: {bad}") from None


def to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json (current HF key set) that describes `cfg`; parsing it gives `cfg` back. A DeepSeek-V4.1
    config is written in the release's composite form (`_v41_composite`)."""
    out: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "sliding_window": cfg.sliding_window,
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": 1,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limit,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        # Not read back from a V4.1 config (ModelConfig.csa_rate / hca_rate are V4's), but kept so any config
        # round-trips.
        "compress_rates": {"compressed_sparse_attention": cfg.csa_rate, "heavily_compressed_attention": cfg.hca_rate},
        "num_nextn_predict_layers": cfg.nextn_layers,
    }
    if cfg.yarn is not None:
        out["rope_scaling"] = {
            "type": "yarn",
            "factor": cfg.yarn.factor,
            "original_max_position_embeddings": cfg.yarn.original_max_position_embeddings,
            "beta_fast": cfg.yarn.beta_fast,
            "beta_slow": cfg.yarn.beta_slow,
        }
    quantization = _quantization_fields(cfg, [cfg.fp8_block] * 2 if cfg.v41 else FP8_WEIGHT_BLOCK)
    if cfg.v41:
        return _v41_composite(cfg, out, quantization)
    kind_names = {v: k for k, v in _HF_LAYER_TYPES.items()}
    out |= {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "layer_types": [kind_names[k] for k in cfg.layer_kinds],
        "mlp_layer_types": ["hash_moe" if h else "moe" for h in cfg.hash_layers],
    }
    if cfg.dspark is not None:
        out["dspark_block_size"] = cfg.dspark.block_size
        out["dspark_noise_token_id"] = cfg.dspark.noise_token_id
        out["dspark_target_layer_ids"] = list(cfg.dspark.target_layer_ids)
        out["dspark_markov_rank"] = cfg.dspark.markov_rank
        out["n_mtp_layers"] = cfg.dspark.stages
    return out | quantization


def _quantization_fields(cfg: ModelConfig, block: list[int]) -> dict[str, Any]:
    """quantization_config and expert_dtype for `cfg`'s storage formats (none when it is dense)."""
    if not cfg.quantized:
        return {}
    out: dict[str, Any] = {
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": block,
            "activation_scheme": "dynamic",
        }
    }
    if cfg.expert_format is not None:  # FP8 projections may come with unquantized experts
        out["expert_dtype"] = {v: k for k, v in _EXPERT_DTYPES.items()}[cfg.expert_format]
    return out


def _v41_composite(cfg: ModelConfig, text: dict[str, Any], quantization: dict[str, Any]) -> dict[str, Any]:
    """A DeepSeek-V4.1 config.json as the release writes it: the text model's fields under `text_config`, the
    storage formats and the image token at the top (no vision tower: jaxserve serves the text model)."""
    kv, engram = cfg.shared_kv, cfg.engram
    assert kv is not None
    text |= {
        "model_type": f"{V41_MODEL_TYPE}_text",
        "compress_ratios": list(kv.ratios),
        "kv_source_layer_ids": list(kv.kv_sources),
        "index_source_layer_ids": list(kv.index_sources),
        "candidate_source_layer_id": kv.candidate_source,
        "candidate_topk_blocks": kv.candidate_topk_blocks,
        "candidate_block_size": kv.candidate_block_size,
    }
    if engram is not None:
        text |= {
            "engram_layer_ids": list(engram.layer_ids),
            "engram_vocab_size": engram.vocab_size,
            "engram_num_embeddings": list(engram.num_embeddings),
            "engram_max_ngram_size": engram.max_ngram,
            "engram_n_heads": engram.n_heads,
            "engram_head_dim": engram.head_dim,
            "engram_pad_id": engram.pad_id,
            "engram_compressed_vocab_size": engram.compressed_vocab_size,
        }
    out: dict[str, Any] = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": V41_MODEL_TYPE}
    if cfg.image_token_id is not None:
        out["image_token_id"] = cfg.image_token_id
    return out | quantization | {"tie_word_embeddings": False, "text_config": text}
