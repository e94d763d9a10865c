"""The executable store (jaxserve/runner/executable_store.py): a runner built again for the same model, geometry,
kernels and devices loads every step it compiled before, without tracing, and serves the same tokens; another
geometry is another key; an entry that cannot be read back is compiled again and rewritten. Each test compiles
into an empty JAX cache of its own (a call JAX's cache had is never stored)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax._src import compilation_cache

from jaxserve.config import EngineConfig
from jaxserve.engine import Engine
from jaxserve.model.cache import kv_geometry
from jaxserve.model.sharding import make_mesh, place
from jaxserve.model.weights import abstract_weights, init_weights
from jaxserve.presets import preset
from jaxserve.request import SamplingParams
from jaxserve.runner import Buckets, ModelRunner
from jaxserve.runner.executable_store import FOLDER

CFG = preset("tiny", dtype="float32")
ENGINE = EngineConfig(
    max_num_seqs=2, chunked_prefill_size=16, max_prefill_rows=1, page_size=8, max_model_len=64, mixed_batches=False
)
BUCKETS = Buckets(prefill_rows=(1,), prefill_chunks=(16,), decode_rows=(2,))


@pytest.fixture
def empty_cache(tmp_path):
    """JAX's persistent cache (and with it the store) in an empty folder for one test."""
    before = jax.config.values["jax_compilation_cache_dir"]
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    compilation_cache.reset_cache()
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def placed():
    mesh = make_mesh(1, 1, jax.devices()[:1])
    return place(init_weights(jax.random.key(7), CFG, std=0.15), abstract_weights(CFG), mesh), mesh


def serve(placed, engine_cfg: EngineConfig = ENGINE):
    """A runner built and warmed up as the engine's start does, the store it used, and the greedy and seeded tokens
    it serves for three prompts."""
    weights, mesh = placed
    runner = ModelRunner(CFG, weights, kv_geometry(engine_cfg, CFG), mesh, BUCKETS)
    runner.warmup()
    engine = Engine(engine_cfg, CFG, runner, (1,)).start()
    rng = np.random.default_rng(3)
    try:
        handles = [
            engine.submit(
                rng.integers(2, CFG.vocab_size, n).tolist(),
                SamplingParams(max_tokens=6, temperature=t, seed=5, ignore_eos=True),
            )
            for n, t in ((5, 0.0), (21, 0.8), (9, 0.0))
        ]
        tokens = [h.wait(120).token_ids for h in handles]
    finally:
        engine.shutdown()
    return runner.executable_cache.store, tokens


def test_a_runner_built_again_loads_its_steps_another_geometry_misses_and_a_bad_entry_is_compiled_again(
    empty_cache, placed, caplog
):
    first, tokens = serve(placed)
    assert first is not None and first.loaded == 0 and first.stored >= 2  # each shape's forward, samplers
    stored = sorted((empty_cache / FOLDER).glob("*.exe"))
    assert len(stored) == first.stored
    again, tokens_again = serve(placed)
    assert (again.loaded, again.stored) == (first.stored, 0)  # nothing traced: every stored call loaded
    assert tokens_again == tokens and all(len(t) == 6 for t in tokens)

    other, _ = serve(placed, EngineConfig(**{**vars(ENGINE), "max_num_seqs": 3}))
    assert other.loaded == 0 and other.stored > 0  # the cache's slots are in every step's arguments

    for entry in stored:
        entry.write_bytes(b"not a compiled step")
    for entry in empty_cache.iterdir():  # JAX's own entries too, so the steps are compiled afresh
        if entry.name != FOLDER:
            entry.unlink()
    with caplog.at_level("WARNING", logger="jaxserve.runner.executable_store"):
        rebuilt, tokens_rebuilt = serve(placed)
    assert rebuilt.loaded == 0 and tokens_rebuilt == tokens
    assert sum("unreadable" in r.getMessage() for r in caplog.records) == first.stored
    # Rewritten: the forwards at least (XLA:CPU serializes a sort only while its comparator is not already compiled
    # in the process, so a sampler that sorts may stay out: it is then only compiled).
    rewritten = [entry for entry in stored if entry.read_bytes() != b"not a compiled step"]
    assert len(rewritten) == rebuilt.stored >= 2
