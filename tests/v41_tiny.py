"""A tiny DeepSeek-V4.1 checkpoint in the release's format, made deterministically from a seed (no torch).

`write_tiny_v41(folder, seed)` writes `config.json`, `model.safetensors` and the embedded default checkpoint's
tokenizer files into `folder`. `tests/v41_make_reference.py` loads the same folder into transformers' DeepSeek-V4.1
(huggingface/transformers@0a2080b43eb64e6d448186a4f3f0bc9c618f4797) and records the reference outputs in
`tests/data/v41_tiny/reference.json`, so jaxserve's reading of this folder is checked against HF's modeling code.

config.json is composite like the release's: `architectures`, `model_type` "deepseek_v41", `image_token_id`,
`quantization_config` (FP8 e4m3, ue8m0 scales, 32x32 blocks here: the release's 128x128 would not block a 64-wide
model), `expert_dtype` "fp4", the text model's fields under `text_config` (TINY_TEXT_CONFIG) and an empty
`vision_config`.

Tensor names are HF's state-dict names less the leading `model.`, with `lm_head.weight` named `head.weight`: the
release's own naming (`embed.weight`, `layers.{i}.attn.wq_a.weight`, `layers.{i}.ffn.experts.{j}.w1.weight`,
`layers.{i}.engram.embed.weight`, ...). Every HF parameter has one tensor of HF's shape (`[out, in]` for linears)
and nothing else is stored, besides the `.scale` beside each quantized weight.

Storage, our reading of the release:
- FP8 e4m3 (float8_e4m3fn) with ue8m0 block scales `<name>.scale` (float8_e8m0fnu, one per 32x32 block:
  `[ceil(out/32), ceil(in/32)]`): attn.wq_a, attn.wq_b, attn.wkv, attn.wo_a, attn.wo_b, attn.indexer.wq_b,
  ffn.shared_experts.w1/w2/w3, engram.wkv, and attn.compressor.wkv at compress ratio 1.
- FP4 e2m1, two per byte along the input dim (int8 `[out, in/2]`, the low nibble the even element), with ue8m0
  scales `[out, in/32]` (1x32 blocks): the routed experts ffn.experts.{j}.w1/w2/w3.
- The engram table engram.embed.weight: FP8 e4m3 `[rows, head_dim]` with engram.embed.scale ue8m0
  `[rows, head_dim/32]` (one scale per 32 channels of a row; HF holds that scale as a parameter of its own).
- F32: hc_attn_fn/base/scale, hc_ffn_fn/base/scale, attn.attn_sink, ffn.gate.bias, ffn.gate.bias_vl, and
  attn.compressor.wkv at compress ratio > 1 (the compressor pools in fp32).
- BF16: everything else (embed, head, the norms, q_norm, kv_norm, compressor.wgate, compressor.norm,
  indexer.weights_proj, indexer.wk, indexer.k_norm, ffn.gate.weight, engram.q_weight, engram.k_weight).

Values: numpy's default_rng(seed), float32 draws in the order of `tiny_params`: matrices (and the embeddings, the
hc_*_fn and the engram table) N(0, 0.15) like HF's initializer_range=0.15; the parameters HF initialises to 0 or 1
are drawn so their paths matter: attention sinks 0.5 N, gate bias / bias_vl 0.1 N, hc bases 0.5 N, hc scales
1 + 0.1 N, engram q_weight / k_weight 1 + 0.2 N, norm weights 1 + 0.1 N. The FP8/FP4 tensors are jaxserve's own
quantizer's rounding of those draws (round to nearest even, power-of-two scales fitting the block's largest value).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.checkpoints.deepseek import BF16, F32, FP4_PACKED, FP8, scale_name
from jaxserve.checkpoints.writer import quantize_tensor, save_tensors
from jaxserve.kernels.quant import FP8 as FP8_E4M3
from jaxserve.kernels.quant import quantize
from jaxserve.model.engram import EngramLayout

ENGRAM_TABLE = "engram_table"  # FP8 e4m3 rows with one ue8m0 scale per 32 channels of a row
FP8_BLOCK = 32  # quantization_config.weight_block_size of the tiny checkpoint
ENGRAM_SCALE_BLOCK = 32
STD = 0.15  # HF's initializer_range for this config

TINY_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 4096,  # the embedded default checkpoint's tokenizer
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    # 2 sliding-only layers, a ratio-2 group (KV source 2), a ratio-1 group (KV source 4); index sources 2, 4 and a
    # "reindex" source 6 inside layer 4's two-level top-k candidates
    "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1],
    "kv_source_layer_ids": [2, 4],
    "index_source_layer_ids": [2, 4, 6],
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 6,
    "candidate_block_size": 4,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus",
    "gate_temp": 1.0,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 512,  # factor 16 x original 32, as the release's 1048576 = 16 x 65536
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "engram_layer_ids": [1, 4],
    "engram_vocab_size": 40,
    "engram_max_ngram_size": 4,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    # rows per engram layer: the sums of its (n-gram, head) primes, drawn in order above engram_vocab_size and never
    # reused ([[41, 43, 47, 53, 59, 61], [67, 71, 73, 79, 83, 89]]); see engram_primes
    "engram_num_embeddings": [304, 462],
    "engram_pad_id": 2,
    # HF's build_compressed_token_map on the default tokenizer (checked at model build by HF)
    "engram_compressed_vocab_size": 2731,
    "num_nextn_predict_layers": 0,
    "dspark_noise_token_id": 3,  # unused (no draft layers); HF's default 128799 lies outside the 4096 ids
    "hidden_act": "silu",
    "initializer_range": STD,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}

QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "activation_scheme": "dynamic",
}


def tiny_config(text_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The composite config.json of the release, around `text_config` (TINY_TEXT_CONFIG by default)."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "image_token_id": 4095,
        "tie_word_embeddings": False,
        "quantization_config": dict(QUANTIZATION_CONFIG),
        "expert_dtype": "fp4",
        "text_config": json.loads(json.dumps(text_config or TINY_TEXT_CONFIG)),
        "vision_config": {},
    }


def engram_primes(cfg: dict[str, Any]) -> list[list[list[int]]]:
    """[engram layer][n-gram size - 2][head] bucket sizes, as jaxserve's Engram layout draws them (the reference
    script checks them against transformers')."""
    layout = EngramLayout.build(
        cfg["engram_layer_ids"],
        cfg["engram_vocab_size"],
        cfg["engram_max_ngram_size"],
        cfg["engram_n_heads"],
        cfg["engram_head_dim"],
        cfg["engram_compressed_vocab_size"],
    )
    heads = cfg["engram_n_heads"]
    return [[list(layer[i : i + heads]) for i in range(0, len(layer), heads)] for layer in layout.primes]


@dataclasses.dataclass(frozen=True)
class Param:
    name: str  # the release's tensor name
    shape: tuple[int, ...]
    init: str  # "normal" (STD), "norm", "sink", "gate_bias", "hc_base", "hc_scale", "engram_qk"
    stored: str  # FP8 (32x32 blocks), FP4_PACKED, ENGRAM_TABLE, F32 or BF16


def tiny_params(cfg: dict[str, Any] | None = None) -> list[Param]:
    """Every HF parameter of DeepseekV41ForCausalLM for text config `cfg`, under the release's name, in draw order.
    (`engram.embed.scale` is the only HF parameter not drawn: it is the table's quantization scale.)"""
    c = cfg or TINY_TEXT_CONFIG
    d, hc, n_heads, head_dim = c["hidden_size"], c["hc_mult"], c["num_attention_heads"], c["head_dim"]
    q_rank, groups, o_rank = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    ix_heads, ix_dim, inter = c["index_n_heads"], c["index_head_dim"], c["moe_intermediate_size"]
    mix = (2 + hc) * hc
    params: list[Param] = [Param("embed.weight", (c["vocab_size"], d), "normal", BF16)]
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        ratio = c["compress_ratios"][i]
        for site in ("attn", "ffn"):
            params += [
                Param(f"{p}hc_{site}_fn", (mix, hc * d), "normal", F32),
                Param(f"{p}hc_{site}_base", (mix,), "hc_base", F32),
                Param(f"{p}hc_{site}_scale", (3,), "hc_scale", F32),
            ]
        params += [
            Param(f"{p}attn_norm.weight", (d,), "norm", BF16),
            Param(f"{p}ffn_norm.weight", (d,), "norm", BF16),
            Param(f"{p}attn.wq_a.weight", (q_rank, d), "normal", FP8),
            Param(f"{p}attn.q_norm.weight", (q_rank,), "norm", BF16),
            Param(f"{p}attn.wq_b.weight", (n_heads * head_dim, q_rank), "normal", FP8),
            Param(f"{p}attn.wkv.weight", (head_dim, d), "normal", FP8),
            Param(f"{p}attn.kv_norm.weight", (head_dim,), "norm", BF16),
            Param(f"{p}attn.wo_a.weight", (groups * o_rank, n_heads * head_dim // groups), "normal", FP8),
            Param(f"{p}attn.wo_b.weight", (d, groups * o_rank), "normal", FP8),
            Param(f"{p}attn.attn_sink", (n_heads,), "sink", F32),
        ]
        kv_source = i in c["kv_source_layer_ids"]
        if kv_source:
            params.append(Param(f"{p}attn.compressor.wkv.weight", (head_dim, d), "normal", F32 if ratio > 1 else FP8))
            if ratio > 1:
                params.append(Param(f"{p}attn.compressor.wgate.weight", (head_dim, d), "normal", BF16))
            params.append(Param(f"{p}attn.compressor.norm.weight", (head_dim,), "norm", BF16))
        if i in c["index_source_layer_ids"]:
            params += [
                Param(f"{p}attn.indexer.wq_b.weight", (ix_heads * ix_dim, q_rank), "normal", FP8),
                Param(f"{p}attn.indexer.weights_proj.weight", (ix_heads, d), "normal", BF16),
            ]
            if kv_source:  # only a KV source derives the shared indexer keys
                params += [
                    Param(f"{p}attn.indexer.wk.weight", (ix_dim, head_dim), "normal", BF16),
                    Param(f"{p}attn.indexer.k_norm.weight", (ix_dim,), "norm", BF16),
                ]
        params += [
            Param(f"{p}ffn.gate.weight", (c["n_routed_experts"], d), "normal", BF16),
            Param(f"{p}ffn.gate.bias", (c["n_routed_experts"],), "gate_bias", F32),
            Param(f"{p}ffn.gate.bias_vl", (c["n_routed_experts"],), "gate_bias", F32),
        ]
        for j in range(c["n_routed_experts"]):
            params += [
                Param(f"{p}ffn.experts.{j}.w1.weight", (inter, d), "normal", FP4_PACKED),
                Param(f"{p}ffn.experts.{j}.w2.weight", (d, inter), "normal", FP4_PACKED),
                Param(f"{p}ffn.experts.{j}.w3.weight", (inter, d), "normal", FP4_PACKED),
            ]
        params += [
            Param(f"{p}ffn.shared_experts.w1.weight", (inter, d), "normal", FP8),
            Param(f"{p}ffn.shared_experts.w2.weight", (d, inter), "normal", FP8),
            Param(f"{p}ffn.shared_experts.w3.weight", (inter, d), "normal", FP8),
        ]
        if i in c["engram_layer_ids"]:
            rows = c["engram_num_embeddings"][c["engram_layer_ids"].index(i)]
            cols = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"]
            params += [
                Param(f"{p}engram.embed.weight", (rows, c["engram_head_dim"]), "normal", ENGRAM_TABLE),
                Param(f"{p}engram.wkv.weight", (d * (hc + 1), cols * c["engram_head_dim"]), "normal", FP8),
                Param(f"{p}engram.q_weight", (hc, d), "engram_qk", BF16),
                Param(f"{p}engram.k_weight", (hc, d), "engram_qk", BF16),
            ]
    params += [
        Param("norm.weight", (d,), "norm", BF16),
        Param("head.weight", (c["vocab_size"], d), "normal", BF16),
    ]
    return params


def _draw(rng: np.random.Generator, param: Param) -> np.ndarray:
    z = rng.standard_normal(param.shape, dtype=np.float32)
    scale, offset = {
        "normal": (STD, 0.0),
        "norm": (0.1, 1.0),
        "sink": (0.5, 0.0),
        "gate_bias": (0.1, 0.0),
        "hc_base": (0.5, 0.0),
        "hc_scale": (0.1, 1.0),
        "engram_qk": (0.2, 1.0),
    }[param.init]
    return (np.float32(offset) + np.float32(scale) * z).astype(np.float32)


def _fp8_blocks(w: np.ndarray, blocks: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    q = quantize(jnp.asarray(w), FP8_E4M3, blocks)
    return np.asarray(q.codes), np.asarray(q.scales).view(ml_dtypes.float8_e8m0fnu)


def tiny_tensors(seed: int = 0, cfg: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Name -> array as the tiny checkpoint stores it (see the module docstring)."""
    c = cfg or TINY_TEXT_CONFIG
    rows = [sum(sum(per) for per in layer) for layer in engram_primes(c)]
    if rows != list(c["engram_num_embeddings"]):
        raise ValueError(f"engram_num_embeddings {c['engram_num_embeddings']} != the prime layout's rows {rows}")
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for param in tiny_params(c):
        w = _draw(rng, param)
        if param.stored == FP8:
            out[param.name], out[scale_name(param.name)] = _fp8_blocks(w, (FP8_BLOCK, FP8_BLOCK))
        elif param.stored == ENGRAM_TABLE:
            out[param.name], out[scale_name(param.name)] = _fp8_blocks(w, (1, ENGRAM_SCALE_BLOCK))
        elif param.stored == FP4_PACKED:
            out[param.name], out[scale_name(param.name)] = quantize_tensor(w, FP4_PACKED)
        elif param.stored == F32:
            out[param.name] = w
        else:
            assert param.stored == BF16, param
            out[param.name] = w.astype(ml_dtypes.bfloat16)
    return {name: np.ascontiguousarray(t) for name, t in out.items()}


def write_tiny_v41(folder: Path, seed: int = 0) -> Path:
    """Write the tiny DeepSeek-V4.1 checkpoint (config.json, model.safetensors, the default checkpoint's tokenizer
    files) into `folder`; returns `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_tensors(tiny_tensors(seed), folder)
    (folder / "config.json").write_text(json.dumps(tiny_config(), indent=2) + "\n")
    source = default_checkpoint_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copyfile(source / name, folder / name)
    return folder
