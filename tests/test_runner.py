"""The device side on 8 fake CPU devices: sharded == single-device, expert weights split 1/8, AOT buckets, no
compiles after warm-up."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from harness import chunk_schedule, prefill_then_decode, run_schedule
from jaxserve.cache import CacheGeometry
from jaxserve.model.weights import abstract_weights, init_weights
from jaxserve.presets import preset
from jaxserve.runner import Buckets, CompileCounter, ModelRunner, Row
from jaxserve.sharding import make_mesh, place

CFG = preset("tiny", dtype="float32")


@pytest.fixture(scope="module")
def weights():
    return init_weights(jax.random.key(3), CFG, std=0.15)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (37, 22, 30)]


@pytest.mark.parametrize("tp, ep", [(8, 1), (2, 4)])
def test_sharded_logits_equal_single_device(weights, prompts, tp, ep):
    schedule = chunk_schedule([[13, 24], [5, 17], [30]]) + prefill_then_decode([0, 0, 0], [0, 0, 0])[1:]
    single = run_schedule(weights, CFG, prompts, schedule, (16, 32))
    mesh = make_mesh(tp, ep)
    sharded_weights = place(weights, abstract_weights(CFG), mesh)
    sharded = run_schedule(sharded_weights, CFG, prompts, schedule, (16, 32), mesh=mesh)
    for a, b in zip(single, sharded):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    # Every device holds exactly 1/8 of every layer's routed-expert stack (the layers axis is never split).
    layers = [layer for segment in sharded_weights.segments for layer in segment]
    assert sum(layer.moe.w_gate.shape[0] for layer in layers) == CFG.num_layers
    for layer in layers:
        for stack in (layer.moe.w_gate, layer.moe.w_up, layer.moe.w_down):
            shards = stack.addressable_shards
            assert len(shards) == 8 and len({s.device for s in shards}) == 8
            assert all(s.data.shape[:2] == (stack.shape[0], CFG.n_routed_experts // 8) for s in shards)
            assert sorted(s.index[1].start for s in shards) == list(range(0, CFG.n_routed_experts, 1))


def test_sharded_decode_tokens_through_the_runner_and_no_compiles_after_warmup(weights, prompts):
    counter = CompileCounter()
    mesh = make_mesh(2, 4)
    geometry = CacheGeometry(num_slots=4, num_pages=24, page_size=8, max_pages_per_seq=6)
    runner = ModelRunner(CFG, place(weights, abstract_weights(CFG), mesh), geometry, mesh,
                         Buckets(prefill_rows=(1, 2), prefill_chunks=(16, 32), decode_rows=(1, 2, 4)))
    runner.warmup()
    assert set(runner.times.compile_s) == {((r, c),) for r, c in [(1, 16), (1, 32), (2, 16), (2, 32), (1, 1), (2, 1), (4, 1)]}
    before = counter.count
    pages = {0: [0, 1, 2, 3, 4, 5], 1: [6, 7, 8, 9, 10, 11], 2: [12, 13, 14, 15, 16, 17]}
    # A varied workload: one and two rows, both chunk buckets, decode batches of 1, 2 and 3 rows.
    first = runner.prefill([Row(prompts[0][:30].tolist(), 0, 0, pages[0])])
    second = runner.prefill([Row(prompts[0][30:].tolist(), 30, 0, pages[0]),
                             Row(prompts[1][:9].tolist(), 0, 1, pages[1])])
    third = runner.prefill([Row(prompts[1][9:].tolist(), 9, 1, pages[1]), Row(prompts[2].tolist(), 0, 2, pages[2])])
    last = {0: int(second[0]), 1: int(third[0]), 2: int(third[1])}
    length = {0: 37, 1: 22, 2: 30}
    for active in ([0], [0, 1], [0, 1, 2], [2]):
        out = runner.decode([Row([last[s]], length[s], s, pages[s]) for s in active])
        for s, token in zip(active, out):
            last[s], length[s] = int(token), length[s] + 1
    assert counter.count == before, "a call after warm-up compiled"
    assert first.shape == (1,) and 0 <= int(first[0]) < CFG.vocab_size
    with pytest.raises(ValueError, match="exceeds the largest compiled bucket"):
        runner.prefill([Row([1] * 33, 0, 3, [18])])
