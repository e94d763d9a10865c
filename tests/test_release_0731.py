"""DeepSeek-V4-Flash-0731's layout (and -Pro-0813's): V4's backbone with a DSpark block drafter in place of the MTP
block. A tiny checkpoint written that way (compress_ratios with the three draft stages' zeros at the tail, the
`dspark_*` keys, the drafter's tensors beside the backbone's, FP8/FP4 as the release stores them) serves over HTTP
the greedy tokens of transformers' backbone on the same weights, the drafter's tensors skipped with one log line;
MTP drafting on it is one clear error before anything is read; DSpark drafting reads the drafter (tests/test_dspark.py
serves it), its heads named either as the release names them or at the top level as this layout has them."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil

import jax
import numpy as np
import pytest
from reference import reference_greedy
from test_quantized_weights import PROMPTS, _greedy_over_http

from jaxserve.checkpoints.deepseek import TensorReader, load_weights
from jaxserve.checkpoints.load import load_model
from jaxserve.checkpoints.orbax_io import convert_checkpoint
from jaxserve.checkpoints.safetensors_file import SafetensorsFolder
from jaxserve.checkpoints.writer import checkpoint_tensors, save_tensors, write_checkpoint
from jaxserve.config import CSA, HCA, SWA, ConfigError, DSparkConfig, load_config
from jaxserve.kernels.quant import FP4, FP8
from jaxserve.model.sharding import make_mesh
from jaxserve.model.weights import flatten_with_names, init_weights
from jaxserve.presets import preset

# hidden 160 and experts 64 wide, as tests/test_quantized_weights.py, for full and partial FP8 / FP4 blocks; HCA at
# the release's rate, 128, which the legacy compress_ratios key says.
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
BACKBONE = preset("tiny", dtype="float32", hidden_size=160, moe_intermediate_size=64, compress_rates=RATES)
DSPARK = DSparkConfig(block_size=5, noise_token_id=3, target_layer_ids=(2, 3, 4), markov_rank=16)
RELEASE = dataclasses.replace(BACKBONE, nextn_layers=1, dspark=DSPARK)
STAGES = 3
RATIOS = {SWA: 0, CSA: 4, HCA: 128}  # the legacy key's values, written here as the release writes them


def drafter_tensors(quantize: bool, dtype: str) -> dict[str, np.ndarray]:
    """The DSpark drafter's tensors: three V4 decoder layers with sliding-window attention only (`mtp.{0,1,2}.*`,
    stored as the backbone's layers are), the first with the projection of the target's features, the last with the
    final norm and HC head; and the Markov and confidence heads."""
    stages = dataclasses.replace(
        BACKBONE, num_layers=STAGES, layer_kinds=(SWA,) * STAGES, hash_layers=(False,) * STAGES
    )
    tensors = checkpoint_tensors(init_weights(jax.random.key(9), stages, std=0.15), stages, quantize, dtype)
    out = {re.sub(r"^layers\.", "mtp.", name): t for name, t in tensors.items() if name.startswith("layers.")}
    last = f"mtp.{STAGES - 1}."
    out |= {last + name: t for name, t in tensors.items() if name.startswith(("norm.", "hc_head_"))}
    rng = np.random.default_rng(0)
    d, vocab, rank = BACKBONE.hidden_size, BACKBONE.vocab_size, DSPARK.markov_rank
    out["mtp.0.main_proj.weight"] = rng.normal(0, 0.1, (d, STAGES * d)).astype(np.float32)
    out["mtp.0.main_norm.weight"] = np.ones(d, np.float32)
    out["markov_head.markov_w1.weight"] = rng.normal(0, 0.1, (vocab, rank)).astype(np.float32)
    out["markov_head.markov_w2.weight"] = rng.normal(0, 0.1, (vocab, rank)).astype(np.float32)
    out["confidence_head.weight"] = rng.normal(0, 0.1, (1, d + rank)).astype(np.float32)
    return out


def write_release(weights, folder, quantize: bool, dtype: str = "bfloat16"):
    """`weights` and a drafter written as the 0731 release lays them out, in one sharded, indexed folder."""
    drafter = drafter_tensors(quantize, dtype)
    write_checkpoint(weights, RELEASE, folder, quantize, dtype, max_shard_bytes=400_000, extra_tensors=drafter)
    file = folder / "config.json"
    raw = json.loads(file.read_text())
    raw["compress_ratios"] = [RATIOS[kind] for kind in BACKBONE.layer_kinds] + [0] * STAGES
    del raw["layer_types"], raw["compress_rates"]
    file.write_text(json.dumps(raw, indent=2))
    return folder, sorted(drafter)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    weights = init_weights(jax.random.key(5), BACKBONE, std=0.1)
    folder, drafter = write_release(weights, tmp_path_factory.mktemp("v4_0731"), quantize=True)
    return dict(folder=folder, drafter=drafter)


def test_the_config_reads_the_backbone_and_the_drafter(release):
    cfg = load_config(release["folder"], dtype="float32")
    assert (cfg.layer_kinds, cfg.hca_rate, cfg.nextn_layers) == (BACKBONE.layer_kinds, 128, 1)
    assert (cfg.dspark, cfg.linear_format, cfg.expert_format) == (DSPARK, FP8, FP4)


def test_the_backbone_serves_transformers_greedy_tokens_with_the_drafter_skipped(release, tmp_path, caplog):
    from transformers import DeepseekV4ForCausalLM

    caplog.set_level(logging.INFO, logger="jaxserve.checkpoints")
    # Pages of 128 tokens: a page holds whole compressed entries of every rate.
    knobs = dict(kernels="reference", dtype="float32", page_size=128, max_model_len=128)
    served = _greedy_over_http(release["folder"], "auto", PROMPTS, **knobs)
    mentions = [r.getMessage() for r in caplog.records if "drafter" in r.getMessage() or "MTP" in r.getMessage()]
    skipped = len(release["drafter"])
    assert mentions == [
        f"skipping {skipped} DSpark drafter tensors (nothing drafts with them: see --speculative-config)"
    ]
    # transformers reads the same weights, decoded, from a float32 copy laid out as the release (drafter included).
    dequantized, _ = load_weights(release["folder"], load_config(release["folder"], "float32").dequantized())
    folder, drafter = write_release(dequantized, tmp_path, quantize=False, dtype="float32")
    model, info = DeepseekV4ForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert set(info["unexpected_keys"]) <= set(drafter) and not any(
        k.startswith("mtp.") for k in info["unexpected_keys"]
    )
    model = model.float().eval()
    assert served == [reference_greedy(model, prompt, 20)[0] for prompt in PROMPTS]


def test_drafting_on_it_is_one_clear_error_before_anything_is_read(release):
    with pytest.raises(ConfigError, match="dspark_block_size=5: the checkpoint ships a DSpark drafter"):
        load_model(release["folder"], make_mesh(1, 1), "float32", drafter="mtp", skip_tokenizer=True)


def test_dspark_drafting_reads_the_drafter_with_its_heads_at_the_top_level(release):
    loaded = load_model(release["folder"], make_mesh(1, 1), "float32", drafter="dspark", skip_tokenizer=True)
    drafter = loaded.weights.dspark
    assert drafter is not None and loaded.config.dspark_drafting
    stored = SafetensorsFolder(release["folder"])
    assert np.array_equal(np.asarray(drafter.markov_embed), stored.get("markov_head.markov_w1.weight"))
    assert np.array_equal(np.asarray(drafter.markov_out), stored.get("markov_head.markov_w2.weight").T)
    assert np.array_equal(np.asarray(drafter.main_proj), stored.get("mtp.0.main_proj.weight").T)


def test_an_orbax_conversion_keeps_the_dspark_drafter(release, tmp_path):
    """Converted, the release restores its DSpark drafter (FP8 / FP4 as stored) exactly as the safetensors load reads
    it, its config from the converted config.json; MTP, which it ships none of, stays refused the same way."""
    dst = convert_checkpoint(release["folder"], tmp_path / "orbax", dtype="float32")
    assert json.loads((dst / "jaxserve_orbax.json").read_text())["drafters"] == ["dspark"]
    mesh = make_mesh(1, 1)
    converted = load_model(dst, mesh, "float32", drafter="dspark", skip_tokenizer=True)
    original = load_model(release["folder"], mesh, "float32", drafter="dspark", skip_tokenizer=True)
    assert converted.config == original.config and converted.config.dspark_drafting
    pairs = zip(flatten_with_names(converted.weights), flatten_with_names(original.weights), strict=True)
    for (path, got), (_, want) in pairs:
        assert got.dtype == want.dtype, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)
    assert any(path.startswith("dspark.") for path, _ in flatten_with_names(converted.weights))
    with pytest.raises(ConfigError, match="dspark_block_size=5: the checkpoint ships a DSpark drafter"):
        load_model(dst, mesh, "float32", drafter="mtp", skip_tokenizer=True)


def _hf_name(name: str) -> str:
    """An official tensor name as transformers' `save_pretrained` names it: behind `model.`, renamed where its layout
    differs (TensorReader.HF_RENAMES, read backwards); a block scale follows its weight; the LM head stays as it is."""
    if name == "head.weight":
        return name
    weight = name[: -len("scale")] + "weight" if name.endswith(".scale") else name
    for pattern, replacement in TensorReader.HF_RENAMES:
        if pattern.match(weight):
            weight = pattern.sub(replacement, weight)
            break
    return "model." + (weight[: -len("weight")] + "scale" if name.endswith(".scale") else weight)


def test_dspark_drafting_reads_the_release_under_transformers_names(release, tmp_path):
    """The same release with every tensor under transformers' names (`model.`-prefixed, its renames; the drafter's
    stages and heads too, as hub conversions store them): the backbone and the DSpark drafter load exactly as from
    the official names."""
    official = SafetensorsFolder(release["folder"])
    hf = tmp_path / "hf"
    save_tensors({_hf_name(name): official.get(name) for name in official.keys()}, hf, max_shard_bytes=400_000)
    shutil.copyfile(release["folder"] / "config.json", hf / "config.json")
    assert any(name.startswith("model.mtp.") for name in SafetensorsFolder(hf).keys())
    mesh = make_mesh(1, 1)
    renamed = load_model(hf, mesh, "float32", drafter="dspark", skip_tokenizer=True)
    original = load_model(release["folder"], mesh, "float32", drafter="dspark", skip_tokenizer=True)
    pairs = zip(flatten_with_names(renamed.weights), flatten_with_names(original.weights), strict=True)
    for (path, got), (_, want) in pairs:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)
