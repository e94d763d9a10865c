"""The export store (jaxserve.runner.export_store): a call compiled from its stored program computes what the traced
call computes, keeps its donation and output shardings, is not traced again, and a damaged or unexportable entry
falls back to tracing."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.model.sharding import make_mesh
from jaxserve.presets import preset
from jaxserve.runner.export_store import ExportStore, JitSpec, describe, store_folder

TRACES: list[str] = []  # appended to while a call is traced, never while it runs


def _step(weights, cache, scale, flip: bool):
    TRACES.append("step")
    y = jnp.einsum("ij,jk->ik", weights["w"], cache) * scale
    return {"out": -y if flip else y, "none": None}, cache + 1.0


@pytest.fixture
def mesh():
    return make_mesh(2, 1)  # 2 devices on the tensor axis


def _spec(mesh) -> JitSpec:
    replicated = NamedSharding(mesh, PartitionSpec())
    columns = NamedSharding(mesh, PartitionSpec(None, mesh.axis_names[-1]))
    return JitSpec(_step, donate_argnames=("cache",), static_argnames=("flip",), out_shardings=(replicated, columns))


def _args(mesh, flip=False):
    replicated = NamedSharding(mesh, PartitionSpec())
    columns = NamedSharding(mesh, PartitionSpec(None, mesh.axis_names[-1]))
    return dict(
        weights={"w": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=replicated)},
        cache=jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=columns),
        scale=jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),
        flip=flip,
    )


def _inputs(mesh):
    rng = np.random.default_rng(0)
    args = _args(mesh)
    weights = {"w": jax.device_put(rng.normal(size=(4, 4)).astype(np.float32), args["weights"]["w"].sharding)}
    cache = jax.device_put(rng.normal(size=(4, 8)).astype(np.float32), args["cache"].sharding)
    return weights, cache, jax.device_put(np.float32(1.5), args["scale"].sharding)


def test_a_stored_call_computes_the_traced_calls_outputs_with_its_shardings_and_donation(tmp_path, mesh):
    spec = _spec(mesh)
    with jax.set_mesh(mesh):
        traced = spec.jitted.lower(**_args(mesh)).compile()
        stored = ExportStore(tmp_path, "context").compile("step", spec, _args(mesh))
    weights, cache, scale = _inputs(mesh)
    want, want_cache = traced(weights=weights, cache=jnp.copy(cache), scale=scale)
    got, got_cache = stored(weights=weights, cache=cache, scale=scale)
    np.testing.assert_array_equal(got["out"], want["out"])
    np.testing.assert_array_equal(got_cache, want_cache)
    assert got["none"] is None
    assert got_cache.sharding == want_cache.sharding and got["out"].sharding == want["out"].sharding
    assert cache.is_deleted()  # donated, as the traced call's cache is
    assert "input_output_alias" in stored.as_text()


def test_a_second_compile_reads_the_entry_and_does_not_trace(tmp_path, mesh):
    spec = _spec(mesh)
    with jax.set_mesh(mesh):
        ExportStore(tmp_path, "context").compile("step", spec, _args(mesh))
        jax.clear_caches()  # as in a new process: JAX's own in-memory traces are gone
        traced = len(TRACES)
        ExportStore(tmp_path, "context").compile("step", _spec(mesh), _args(mesh))
        assert len(TRACES) == traced
        # Another static value, another context or other shapes: another entry, traced.
        ExportStore(tmp_path, "context").compile("step", spec, _args(mesh, flip=True))
        ExportStore(tmp_path, "another context").compile("step", spec, _args(mesh))
        assert len(TRACES) == traced + 2 and len(list(tmp_path.glob("step-*.pickle"))) == 3
    assert not list(tmp_path.glob("*.partial"))


def test_a_damaged_entry_is_traced_again_with_a_warning_and_replaced(tmp_path, mesh, caplog):
    spec = _spec(mesh)
    with jax.set_mesh(mesh):
        ExportStore(tmp_path, "context").compile("step", spec, _args(mesh))
        (entry,) = tmp_path.glob("step-*.pickle")
        entry.write_bytes(entry.read_bytes()[:100])
        jax.clear_caches()
        traced = len(TRACES)
        with caplog.at_level(logging.WARNING, logger="jaxserve.runner.export_store"):
            stored = ExportStore(tmp_path, "context").compile("step", spec, _args(mesh))
    assert len(TRACES) == traced + 1 and entry.name in caplog.text and "unreadable" in caplog.text
    assert len(entry.read_bytes()) > 100
    weights, cache, scale = _inputs(mesh)
    got, _ = stored(weights=weights, cache=cache, scale=scale)
    np.testing.assert_allclose(got["out"], np.asarray(weights["w"]) @ np.asarray(_inputs(mesh)[1]) * 1.5, rtol=1e-6)


def _with_callback(x):
    return jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def test_a_call_jax_cannot_export_is_compiled_as_traced_and_not_tried_again(tmp_path, mesh, monkeypatch):
    replicated = NamedSharding(mesh, PartitionSpec())
    spec = JitSpec(_with_callback, out_shardings=replicated)
    args = dict(x=jax.ShapeDtypeStruct((3,), jnp.float32, sharding=replicated))
    with jax.set_mesh(mesh):
        compiled = ExportStore(tmp_path, "context").compile("callback", spec, args)
        np.testing.assert_array_equal(compiled(x=jax.device_put(np.arange(3, dtype=np.float32), replicated)), [0, 2, 4])
        (entry,) = tmp_path.glob("callback-*.pickle")
        tried = []
        monkeypatch.setattr(ExportStore, "_export", staticmethod(lambda *args: tried.append(args)))
        again = ExportStore(tmp_path, "context").compile("callback", spec, args)
    assert not tried
    np.testing.assert_array_equal(again(x=jax.device_put(np.arange(3, dtype=np.float32), replicated)), [0, 2, 4])


def test_the_store_is_on_exactly_where_the_compilation_cache_is(tmp_path):
    before = jax.config.values["jax_compilation_cache_dir"]
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        assert store_folder() == tmp_path / "jaxserve-exported"
        jax.config.update("jax_compilation_cache_dir", None)
        assert store_folder() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


DESCRIBE = """
import json, sys
from jaxserve.kernels.table import kernels_for
from jaxserve.model.sharding import make_mesh
from jaxserve.presets import preset
from jaxserve.runner.export_store import describe
print(json.dumps(describe((preset("tiny"), make_mesh(2, 1), [kernels_for(k, "cpu") for k in ("reference", "pallas")]))))
"""


def test_descriptions_are_the_same_in_another_process_and_objects_without_one_are_refused(mesh):
    from jaxserve.kernels.table import kernels_for

    here = describe((preset("tiny"), mesh, [kernels_for(k, "cpu") for k in ("reference", "pallas")]))
    done = subprocess.run([sys.executable, "-c", DESCRIBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == here
    assert "grouped_matmul" in here and "0x" not in here

    class Opaque:
        pass

    with pytest.raises(TypeError, match="no stable description of a .*Opaque"):
        describe(Opaque())
