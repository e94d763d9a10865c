"""The layer plan: layers split into repeated patterns of one kind each, the forward traced once per pattern
position whatever the depth, and checkpoints loaded and restored into the stacks exactly, with the target
shardings, on 8 fake CPU devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from harness import geometry_for, prefill_then_decode, run_schedule

from jaxserve.checkpoints.deepseek import load_weights
from jaxserve.checkpoints.orbax_io import convert_checkpoint, restore_weights
from jaxserve.checkpoints.writer import write_checkpoint
from jaxserve.config import CSA, HCA, SWA
from jaxserve.model.cache import abstract_cache
from jaxserve.model.forward import logits_all
from jaxserve.model.inputs import StepInputs
from jaxserve.model.segments import LayerKind, Segment, layer_segments
from jaxserve.model.sharding import make_mesh, shape_dtype_structs, shardings_for
from jaxserve.model.weights import abstract_weights, flatten_with_names, init_weights
from jaxserve.presets import preset

_SWA, _CSA, _HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
SWA_HASH, CSA_HASH = LayerKind(SWA, True), LayerKind(CSA, True)
HCA_TOPK, CSA_TOPK, SWA_TOPK = LayerKind(HCA, False), LayerKind(CSA, False), LayerKind(SWA, False)


def flash_like(repeats: int, **overrides):
    """The tiny preset with Flash's layer pattern: 2 SWA, `repeats` x (CSA, HCA), CSA; the first 3 hash-routed."""
    types = [_SWA, _SWA] + [_CSA, _HCA] * repeats + [_CSA]
    return preset(
        "tiny", dtype="float32", num_hidden_layers=len(types), layer_types=types, num_hash_layers=3, **overrides
    )


CFG = flash_like(2)  # [SWA hash] x 2, [CSA hash], [HCA, CSA] x 2


def test_flash_compiles_four_layer_bodies():
    assert layer_segments(preset("flash")) == (
        Segment(0, (SWA_HASH,), 2),
        Segment(2, (CSA_HASH,), 1),
        Segment(3, (HCA_TOPK, CSA_TOPK), 20),
    )
    # Cut to 4 layers, the (CSA hash, HCA) tail is one pattern repeated once: fewer segments for the same bodies.
    assert layer_segments(preset("flash", num_hidden_layers=4)) == (
        Segment(0, (SWA_HASH,), 2),
        Segment(2, (CSA_HASH, HCA_TOPK), 1),
    )


@pytest.mark.parametrize(
    "types, hashed, want",
    [
        # No repetition: one segment of every layer once.
        ([_SWA, _CSA, _HCA, _CSA, _SWA], 2, [((SWA_HASH, CSA_HASH, HCA_TOPK, CSA_TOPK, SWA_TOPK), 1)]),
        # Routing splits what attention alone would repeat.
        ([_CSA] * 5, 2, [((CSA_HASH,), 2), ((CSA_TOPK,), 3)]),
        # A two-layer pattern between runs of other kinds.
        (
            [_SWA, _HCA, _CSA, _HCA, _CSA, _SWA, _SWA],
            0,
            [((SWA_TOPK,), 1), ((HCA_TOPK, CSA_TOPK), 2), ((SWA_TOPK,), 2)],
        ),
    ],
)
def test_segments_cover_every_layer_once_with_its_kind(types, hashed, want):
    cfg = preset("tiny", num_hidden_layers=len(types), layer_types=types, num_hash_layers=hashed)
    segments = layer_segments(cfg)
    assert [(s.pattern, s.repeats) for s in segments] == want
    layers = [(s.layer(k, p), kind) for s in segments for k in range(s.repeats) for p, kind in enumerate(s.pattern)]
    assert [layer for layer, _ in layers] == list(range(cfg.num_layers))
    assert [kind for _, kind in layers] == [LayerKind(a, h) for a, h in zip(cfg.layer_kinds, cfg.hash_layers)]


def _jaxpr_size(cfg) -> int:
    geo = geometry_for(cfg, rows=2, max_len=32)
    weights = shape_dtype_structs(abstract_weights(cfg), make_mesh(1, 1))
    cache = shape_dtype_structs(abstract_cache(cfg, geo), make_mesh(1, 1))
    ints = jax.ShapeDtypeStruct((2,), np.int32)
    inputs = StepInputs(
        tokens=jax.ShapeDtypeStruct((2, 8), np.int32),
        positions=ints,
        lengths=ints,
        slots=ints,
        page_table=jax.ShapeDtypeStruct((2, geo.max_pages_per_seq), np.int32),
    )
    return _equations(jax.make_jaxpr(lambda w, c, i: logits_all(w, c, i, cfg))(weights, cache, inputs).jaxpr)


def _equations(jaxpr) -> int:
    """Equations of a jaxpr, those of the jaxprs inside it (scan bodies, ...) included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    count += _equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    count += _equations(sub)
    return count


def test_traced_forward_does_not_grow_with_depth():
    assert _jaxpr_size(flash_like(2)) == _jaxpr_size(flash_like(12))
    assert _jaxpr_size(flash_like(0)) < _jaxpr_size(flash_like(2))  # the measure sees one more pattern position


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    weights = init_weights(jax.random.key(8), CFG, std=0.15)
    src = write_checkpoint(weights, CFG, root / "safetensors", dtype="float32")
    return weights, src, root


def _assert_same(got, want, mesh):
    shardings = flatten_with_names(shardings_for(abstract_weights(CFG), mesh))
    for (path, g), (_, w), (_, s) in zip(flatten_with_names(got), flatten_with_names(want), shardings):
        assert g.shape == w.shape and g.dtype == w.dtype, path
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=path)
        assert g.sharding.is_equivalent_to(s, g.ndim), (path, g.sharding, s)


def test_loading_fills_the_stacks_exactly_with_the_target_shardings(checkpoint):
    weights, src, _ = checkpoint
    mesh = make_mesh(2, 4)
    loaded, _ = load_weights(src, CFG, shardings_for(abstract_weights(CFG), mesh))
    _assert_same(loaded, weights, mesh)
    # The scanned forward over the sharded stacks (experts split over the mesh) gives the single-device logits.
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (21, 12)]
    schedule = prefill_then_decode([14, 5], [21, 12])
    single = run_schedule(weights, CFG, prompts, schedule, (1, 16))
    for want, got in zip(single, run_schedule(loaded, CFG, prompts, schedule, (1, 16), mesh=mesh)):
        # Heads and vocabulary split 2 ways sum in another order: float32 rounding, no more.
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)


def test_orbax_restore_fills_the_stacks_exactly_with_the_target_shardings(checkpoint):
    weights, src, root = checkpoint
    dst = convert_checkpoint(src, root / "converted", dtype="float32")
    assert (dst / "layer_06").is_dir()  # the conversion stays one item per layer
    mesh = make_mesh(4, 2)
    _assert_same(restore_weights(dst, CFG, mesh), weights, mesh)
