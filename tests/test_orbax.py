"""Orbax conversion on 8 fake CPU devices: a safetensors folder converted once, restored exactly into two different
meshes with the target shardings, giving the same logits as the safetensors load; load_model dispatches on it."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax
import numpy as np
import pytest
from harness import prefill_then_decode, run_schedule

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.checkpoints.deepseek import load_weights
from jaxserve.checkpoints.load import load_model
from jaxserve.checkpoints.orbax_io import convert_checkpoint, is_orbax_checkpoint, restore_weights
from jaxserve.checkpoints.safetensors_file import CheckpointError
from jaxserve.checkpoints.writer import write_checkpoint
from jaxserve.model.sharding import make_mesh, shardings_for
from jaxserve.model.weights import abstract_weights, flatten_with_names, init_weights
from jaxserve.presets import preset
from jaxserve.text.tokenizer import Tokenizer

CFG = preset("tiny", dtype="float32")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(original weights, safetensors folder, orbax conversion) of a random tiny model."""
    root = tmp_path_factory.mktemp("orbax")
    weights = init_weights(jax.random.key(5), CFG, std=0.15)
    src = write_checkpoint(weights, CFG, root / "safetensors", dtype="float32")
    return weights, src, convert_checkpoint(src, root / "converted", dtype="float32")


@pytest.mark.parametrize("tp, ep", [(4, 2), (2, 4)])
def test_restore_is_exact_carries_target_shardings_and_gives_the_same_logits(converted, tp, ep):
    weights, src, dst = converted
    mesh = make_mesh(tp, ep)
    shardings = shardings_for(abstract_weights(CFG), mesh)
    restored = restore_weights(dst, CFG, mesh)
    for (path, got), (_, want), (_, sharding) in zip(
        flatten_with_names(restored), flatten_with_names(weights), flatten_with_names(shardings)
    ):
        assert got.dtype == want.dtype, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)
        assert got.sharding.is_equivalent_to(sharding, got.ndim), (path, got.sharding, sharding)

    from_safetensors, _ = load_weights(src, CFG, shardings)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (13, 10)]
    schedule = prefill_then_decode([9, 6], [13, 10])
    expected = run_schedule(from_safetensors, CFG, prompts, schedule, (16,), mesh=mesh)
    for want, got in zip(expected, run_schedule(restored, CFG, prompts, schedule, (16,), mesh=mesh)):
        np.testing.assert_array_equal(got, want)


def test_load_model_restores_a_conversion_with_its_tokenizer(tmp_path):
    dst = convert_checkpoint(default_checkpoint_path(), tmp_path / "default")  # bfloat16, the engine's default
    assert is_orbax_checkpoint(dst) and not is_orbax_checkpoint(default_checkpoint_path())
    mesh = make_mesh(2, 4)
    converted, original = load_model(dst, mesh), load_model(None, mesh)
    assert converted.config == original.config
    assert isinstance(converted.tokenizer, Tokenizer)
    assert converted.tokenizer.encode("Where does the river run?") == original.tokenizer.encode(
        "Where does the river run?"
    )
    for (path, got), (_, want) in zip(flatten_with_names(converted.weights), flatten_with_names(original.weights)):
        assert got.dtype == want.dtype and got.sharding == want.sharding, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)
    # The default's drafters (its MTP block, and its DSpark drafter kept beside it in dspark/) come along: each
    # restores exactly as the safetensors load reads it.
    marker = dst / "jaxserve_orbax.json"
    assert json.loads(marker.read_text())["drafters"] == ["dspark", "mtp"]
    for method, prefix in (("mtp", "mtp."), ("dspark", "dspark.")):
        drafting, original = load_model(dst, mesh, drafter=method), load_model(None, mesh, drafter=method)
        assert drafting.config == original.config
        pairs = zip(flatten_with_names(drafting.weights), flatten_with_names(original.weights), strict=True)
        for (path, got), (_, want) in pairs:
            assert got.sharding == want.sharding, path
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)
        assert any(path.startswith(prefix) for path, _ in flatten_with_names(drafting.weights)), method
    # A conversion without them (a jaxserve that converted the backbone only wrote no list): a clear error.
    marker.write_text(
        json.dumps({key: value for key, value in json.loads(marker.read_text()).items() if key != "drafters"})
    )
    for method, what in (("mtp", "MTP block"), ("dspark", "DSpark drafter")):
        with pytest.raises(CheckpointError, match=f"holds no {what}.*convert again.*method '{method}'"):
            load_model(dst, mesh, drafter=method)


def test_errors_name_the_path(converted, tmp_path):
    _, src, dst = converted
    mesh = make_mesh(4, 2)
    with pytest.raises(CheckpointError, match=re.escape(f"{dst}: already exists; pass overwrite=True")):
        convert_checkpoint(src, dst, dtype="float32")
    with pytest.raises(CheckpointError, match=re.escape(f"{src.parent}: holds the source")):
        convert_checkpoint(src, src.parent, dtype="float32", overwrite=True)
    with pytest.raises(CheckpointError, match="converted as float32, but bfloat16 was asked for"):
        restore_weights(dst, CFG.with_dtype("bfloat16"), mesh)
    with pytest.raises(CheckpointError, match=re.escape(f"{dst / 'config.json'}") + ".* in rope_theta"):
        restore_weights(dst, dataclasses.replace(CFG, rope_theta=5e4), mesh)

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "stale").write_text("from an earlier run")
    convert_checkpoint(src, damaged, dtype="float32", overwrite=True)
    assert not (damaged / "stale").exists()
    shutil.rmtree(damaged / "layer_02")
    with pytest.raises(CheckpointError, match=re.escape(f"{damaged / 'layer_02'}: layer directory missing")):
        restore_weights(damaged, CFG, mesh)
