"""Checkpoint folders -> Weights: DeepSeek-named FP8/FP4 checkpoints (written by checkpoints.writer) decode exactly
as the spec says, run like transformers' model on the same weights, both naming schemes agree, and damaged
folders fail with one clear error naming the file and the tensor."""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from harness import run_schedule
from safetensors.numpy import save_file
from safetensors.torch import load_file as load_torch_file

from jaxserve.checkpoints.deepseek import load_weights, weight_sources
from jaxserve.checkpoints.safetensors_file import CheckpointError
from jaxserve.checkpoints.writer import checkpoint_tensors, save_tensors, write_checkpoint, write_config
from jaxserve.config import ConfigError, load_config
from jaxserve.kernels.quant import FP4, FP8
from jaxserve.model.weights import init_weights, layer_arrays
from jaxserve.presets import preset

TOL = 1e-4
# hidden 160: FP8 projections get a full and a partial 128-block along d (and the indexer's wq_b two full
# row blocks); experts 64 wide: FP4 rows of five (w1, w3) and two (w2) 32-blocks.
CFG = preset("tiny", dtype="float32", hidden_size=160, moe_intermediate_size=64)

# Which release tensors are FP8 (128x128 scales) and which packed FP4 (1x32 scales).
FP8_NAME = re.compile(
    r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])"
    r"\.weight$"
)
FP4_NAME = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
# The release's decoding of them, written out again here so the loader's own tables are not the oracle.
E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    bits = codes.view(np.uint8).astype(np.int64)
    sign = np.where(bits >> 7, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    value = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.where((exponent == 15) & (mantissa == 7), np.nan, sign * value)


def decode_e8m0(scale: np.ndarray) -> np.ndarray:
    return 2.0 ** (scale.view(np.uint8).astype(np.int64) - 127)


def expected_dequantized(raw: dict[str, np.ndarray], name: str) -> np.ndarray:
    weight = raw[name]
    if FP8_NAME.match(name):
        scale = decode_e8m0(raw[name[: -len("weight")] + "scale"])
        rows, cols = np.arange(weight.shape[0])[:, None] // 128, np.arange(weight.shape[1])[None, :] // 128
        return decode_e4m3(weight) * scale[rows, cols]
    if FP4_NAME.match(name):
        scale = decode_e8m0(raw[name[: -len("weight")] + "scale"])
        byte = weight.view(np.uint8)
        values = np.empty((byte.shape[0], 2 * byte.shape[1]))
        values[:, 0::2] = np.array(E2M1)[byte & 0xF]  # low nibble: the even element
        values[:, 1::2] = np.array(E2M1)[byte >> 4]
        return values * scale[:, np.arange(values.shape[1]) // 32]
    return weight.astype(np.float64)


def read_file(file) -> dict[str, np.ndarray]:
    """The safetensors library's own reading (through torch: its numpy side has no E8M0), not the loader's."""
    import torch

    views = {
        torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
        torch.float8_e8m0fnu: (torch.uint8, ml_dtypes.float8_e8m0fnu),
        torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
    }
    out = {}
    for name, tensor in load_torch_file(file).items():
        if tensor.dtype in views:
            as_int, dtype = views[tensor.dtype]
            out[name] = tensor.view(as_int).numpy().view(dtype)
        else:
            out[name] = tensor.numpy()
    return out


def read_folder(folder) -> dict[str, np.ndarray]:
    raw = {}
    for file in sorted(folder.glob("*.safetensors")):
        raw.update(read_file(file))
    return raw


def leaves(weights) -> dict[str, np.ndarray]:
    """Per layer, by release name (the names weight_sources uses)."""
    return dict(layer_arrays(weights, CFG))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A tiny model written in DeepSeek naming with FP8 and FP4 tensors, sharded, and loaded back."""
    original = init_weights(jax.random.key(3), CFG, std=0.15)
    folder = tmp_path_factory.mktemp("quantized")
    write_checkpoint(original, CFG, folder, quantize=True, max_shard_bytes=150_000)
    loaded, _ = load_weights(folder, CFG)
    return dict(folder=folder, original=original, loaded=loaded)


@pytest.fixture(scope="module")
def hf_model(quantized, tmp_path_factory):
    """transformers' DeepSeek-V4 reading the dequantized weights, written unquantized in the official naming."""
    from transformers import DeepseekV4ForCausalLM

    folder = tmp_path_factory.mktemp("dequantized")
    write_checkpoint(quantized["loaded"], CFG, folder, dtype="float32")
    model, info = DeepseekV4ForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    return dict(model=model.float().eval(), folder=folder)


def test_quantized_tensors_are_stored_like_the_release(quantized):
    folder = quantized["folder"]
    raw = read_folder(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(raw) and len(set(index["weight_map"].values())) > 1
    config = load_config(folder, dtype="float32")  # says what the release's says: FP8 projections, FP4 experts
    assert (config.linear_format, config.expert_format) == (FP8, FP4) and config.dequantized() == CFG

    weights = [n for n in raw if n.endswith(".weight")]
    fp8, fp4 = [n for n in weights if FP8_NAME.match(n)], [n for n in weights if FP4_NAME.match(n)]
    # per layer 5 attention projections and 3 shared-expert ones, plus the indexer wq_b of the 2 CSA layers
    assert len(fp8) == 5 * (5 + 3) + 2 and len(fp4) == 5 * 8 * 3
    assert sorted(n for n in raw if n.endswith(".scale")) == sorted(n[: -len("weight")] + "scale" for n in fp8 + fp4)
    for name in fp8:
        o, i = raw[name].shape
        assert raw[name].dtype == ml_dtypes.float8_e4m3fn, name
        assert raw[name[:-6] + "scale"].dtype == ml_dtypes.float8_e8m0fnu
        assert raw[name[:-6] + "scale"].shape == (-(-o // 128), -(-i // 128)), name
    for name in fp4:
        o, half = raw[name].shape
        assert raw[name].dtype == np.int8 and raw[name[:-6] + "scale"].shape == (o, 2 * half // 32), name
    assert raw["layers.1.ffn.experts.3.w1.weight"].shape == (64, 80)
    assert raw["layers.1.ffn.experts.3.w2.weight"].shape == (160, 32)
    assert raw["layers.1.attn.indexer.wq_b.scale"].shape == (2, 1)
    assert raw["layers.1.attn.wkv.scale"].shape == (1, 2)
    assert raw["layers.1.attn.compressor.wkv.weight"].dtype == ml_dtypes.bfloat16
    assert raw["layers.1.hc_attn_fn"].dtype == np.float32 and raw["layers.1.attn.attn_sink"].dtype == np.float32
    assert raw["layers.0.ffn.gate.tid2eid"].dtype == np.int64 and raw["layers.3.ffn.gate.bias"].dtype == np.float32


def test_dequantized_weights_match_the_spec_decoding(quantized):
    raw = read_folder(quantized["folder"])
    sources = weight_sources(CFG)
    loaded, original = leaves(quantized["loaded"]), leaves(quantized["original"])
    for path, got in loaded.items():
        names = sources[path].names
        want = sources[path].build([expected_dequantized(raw, n) for n in names]).astype(np.float32)
        np.testing.assert_array_equal(got, want, err_msg=path)
        # ... and the quantization is faithful: e4m3 keeps 3 mantissa bits, e2m1 one.
        err, scale = np.abs(got - original[path]), np.abs(original[path]).max()
        if FP8_NAME.match(names[0]):
            assert np.all(err <= np.abs(original[path]) / 16 + scale * 2.0**-9), path
        elif FP4_NAME.match(names[0]):
            assert err.max() <= scale / 4, path


def test_forward_matches_transformers_on_the_dequantized_weights(quantized, hf_model):
    import torch

    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (41, 29)]
    got = run_schedule(quantized["loaded"], CFG, prompts, [[41, 29]], buckets=(48,))
    with torch.no_grad():
        want = [hf_model["model"](torch.as_tensor(p[None].astype(np.int64))).logits[0].numpy() for p in prompts]
    error = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    scale = max(float(np.abs(w).max()) for w in want)
    print(
        f"jaxserve vs transformers on FP8/FP4-dequantized weights: max abs logit error {error:.2e} "
        f"(logit scale {scale:.2f})"
    )
    assert scale > 0.5 and error < TOL


def test_both_naming_schemes_give_identical_weights(quantized, hf_model, tmp_path):
    hf_model["model"].save_pretrained(tmp_path)
    assert any(k.startswith("model.layers.") for k in read_folder(tmp_path))
    from_hf, _ = load_weights(tmp_path, CFG)
    from_official, _ = load_weights(hf_model["folder"], CFG)
    a, b = leaves(from_hf), leaves(from_official)
    assert a.keys() == b.keys()
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)
        np.testing.assert_array_equal(a[path], leaves(quantized["loaded"])[path], err_msg=path)


def test_mtp_tensors_are_skipped_with_one_log_line(quantized, tmp_path, caplog):
    shutil.copytree(quantized["folder"], tmp_path, dirs_exist_ok=True)
    save_file(
        {
            "mtp.0.e_proj.weight": np.zeros((160, 160), ml_dtypes.bfloat16),
            "mtp.0.enorm": np.ones(160, ml_dtypes.bfloat16),
            "mtp.0.hc_head_base": np.zeros(4, np.float32),
        },
        str(tmp_path / "mtp.safetensors"),
    )
    caplog.set_level(logging.INFO, logger="jaxserve.checkpoints")
    loaded, _ = load_weights(tmp_path, CFG)
    mentions = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert len(mentions) == 1 and "3 MTP tensors" in mentions[0], mentions
    for path, leaf in leaves(loaded).items():
        np.testing.assert_array_equal(leaf, leaves(quantized["loaded"])[path], err_msg=path)


# ---- damaged checkpoints --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_tensors(quantized):
    return checkpoint_tensors(quantized["original"], CFG, quantize=True)


def _rewrite(folder, tensors, change):
    tensors = dict(tensors)
    change(tensors)
    for file in folder.glob("model*.safetensors*"):
        file.unlink()
    save_tensors(tensors, folder)


def _drop(*names):
    def change(tensors):
        for name in names:
            del tensors[name]

    return change


def _replace(name, array):
    def change(tensors):
        tensors[name] = array

    return change


def _edit_bytes(file, edit):
    data = bytearray(file.read_bytes())
    file.write_bytes(bytes(edit(data)))


def _truncate(data):
    return data[:-100]


def _break_header_json(data):
    data[8] = ord("[")  # the header's opening brace
    return data


def _huge_header_length(data):
    data[:8] = struct.pack("<Q", 10**12)
    return data


def _set_model_type(folder, model_type):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))


DAMAGE = {  # name: (damage(folder, good tensors), error type, where the message starts, phrases it contains)
    "missing tensors": (
        lambda f, t: _rewrite(
            f,
            t,
            _drop(
                "norm.weight",
                "layers.4.hc_ffn_base",
                "layers.2.ffn.experts.5.w2.weight",
                "layers.2.ffn.experts.5.w2.scale",
            ),
        ),
        CheckpointError,
        "{folder}",
        ["3 tensors missing", "norm.weight", "layers.4.hc_ffn_base", "layers.2.ffn.experts.5.w2.weight"],
    ),
    "wrong shape": (
        lambda f, t: _rewrite(f, t, _replace("layers.3.attn.kv_norm.weight", np.ones(31, ml_dtypes.bfloat16))),
        CheckpointError,
        "{file}",
        ["tensor 'layers.3.attn.kv_norm.weight' has shape [31]", "needs [32]"],
    ),
    "wrong packed expert shape": (
        lambda f, t: _rewrite(
            f,
            t,
            lambda ts: ts.update(
                {
                    "layers.0.ffn.experts.6.w2.weight": np.zeros((150, 32), np.int8),
                    "layers.0.ffn.experts.6.w2.scale": np.ones((150, 2), ml_dtypes.float8_e8m0fnu),
                }
            ),
        ),
        CheckpointError,
        "{file}",
        ["tensor 'layers.0.ffn.experts.6.w2.weight' has shape [150, 32]", "[150, 64] dequantized", "needs [160, 64]"],
    ),
    "wrong scale shape": (
        lambda f, t: _rewrite(f, t, _replace("layers.1.attn.wq_a.scale", np.ones((2, 2), ml_dtypes.float8_e8m0fnu))),
        CheckpointError,
        "{file}",
        ["tensor 'layers.1.attn.wq_a.scale' has shape [2, 2]", "shape [1, 2]"],
    ),
    "missing scale": (
        lambda f, t: _rewrite(f, t, _drop("layers.2.attn.wo_b.scale")),
        CheckpointError,
        "{file}",
        ["tensor 'layers.2.attn.wo_b.weight'", "'layers.2.attn.wo_b.scale' is missing"],
    ),
    "unknown model_type": (lambda f, t: _set_model_type(f, "llama"), ConfigError, "{config}", ["model_type='llama'"]),
    "truncated file": (
        lambda f, t: _edit_bytes(f / "model.safetensors", _truncate),
        CheckpointError,
        "{file}",
        ["truncated safetensors file: tensor '"],
    ),
    "corrupted header": (
        lambda f, t: _edit_bytes(f / "model.safetensors", _break_header_json),
        CheckpointError,
        "{file}",
        ["corrupted safetensors header"],
    ),
    "corrupted header length": (
        lambda f, t: _edit_bytes(f / "model.safetensors", _huge_header_length),
        CheckpointError,
        "{file}",
        ["corrupted safetensors header", str(10**12)],
    ),
    "missing config.json": (lambda f, t: (f / "config.json").unlink(), ConfigError, "{config}", ["not found"]),
}


def _expect_one_error(folder, error, place, phrases):
    with pytest.raises(error) as caught:
        load_weights(folder)
    message = str(caught.value)
    assert message.startswith(str(place)), message
    for phrase in phrases:
        assert phrase in message, (phrase, message)
    print(message)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_gives_one_clear_error(damage, good_tensors, tmp_path):
    make_damage, error, where, phrases = DAMAGE[damage]
    save_tensors(good_tensors, tmp_path)
    write_config(CFG, tmp_path)
    load_weights(tmp_path, CFG)  # undamaged, it loads
    make_damage(tmp_path, good_tensors)
    place = where.format(folder=tmp_path, file=tmp_path / "model.safetensors", config=tmp_path / "config.json")
    _expect_one_error(tmp_path, error, place, phrases)


def test_missing_shard_is_named_by_the_index(good_tensors, tmp_path):
    files = save_tensors(good_tensors, tmp_path, max_shard_bytes=150_000)
    write_config(CFG, tmp_path)
    lost = set(read_file(files[1]))
    files[1].unlink()
    with pytest.raises(CheckpointError) as caught:
        load_weights(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'model.safetensors.index.json'}: names shard(s) missing"), message
    named = re.search(rf"{re.escape(files[1].name)} \(e\.g\. tensor '([^']+)'\)", message)
    assert named and named.group(1) in lost, message


MTP_CFG = preset("tiny", dtype="float32", hidden_size=160, moe_intermediate_size=64, num_nextn_predict_layers=1)


def _hf_name(name: str) -> str:
    """A release tensor name as transformers' save_pretrained lays names out (`model.` before all but the head)."""
    if name == "head.weight":
        return name
    name = re.sub(r"^embed\.weight$", "embed_tokens.weight", name)
    name = re.sub(r"^((?:mtp\.\d+\.)?)hc_head_(fn|base|scale)$", r"\1hc_head.hc_\2", name)
    name = re.sub(r"^((?:layers|mtp)\.\d+\.attn)\.kv_norm\.weight$", r"\1.norm.weight", name)
    return "model." + name


@pytest.mark.parametrize("naming", ["release", "transformers"])
def test_mtp_blocks_load_in_both_naming_schemes(naming, tmp_path):
    cfg = MTP_CFG.with_mtp(1)
    original = init_weights(jax.random.key(4), cfg, std=0.15)
    tensors = checkpoint_tensors(original, cfg, dtype="float32")
    assert {"mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight", "mtp.0.ffn.gate.bias"} <= set(tensors)
    if naming == "transformers":
        tensors = {_hf_name(name): tensor for name, tensor in tensors.items()}
    save_tensors(tensors, tmp_path)
    write_config(cfg, tmp_path)
    loaded, _ = load_weights(tmp_path, cfg)
    mtp = {name: value for name, value in layer_arrays(loaded, cfg) if name.startswith("mtp.")}
    expected = dict(layer_arrays(original, cfg))
    assert "mtp.0.block" not in " ".join(mtp) and len(mtp) > 20  # named as the release names a layer's leaves
    for name, value in mtp.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_asking_for_mtp_blocks_a_checkpoint_lacks_is_one_clear_error(quantized):
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=0: the checkpoint has 0 MTP blocks, 1 were"):
        CFG.with_mtp(1)
    # Declared but not shipped: every missing MTP tensor is named at once, before anything is read.
    with pytest.raises(CheckpointError, match=r"tensors missing from the checkpoint: mtp\.0\."):
        load_weights(quantized["folder"], MTP_CFG.with_mtp(1))
