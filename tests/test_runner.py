"""The device side on 8 fake CPU devices: sharded == single-device, expert weights split 1/8, AOT buckets, no
compiles after warm-up."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from harness import chunk_schedule, prefill_then_decode, run_schedule

from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.model.cache import CacheGeometry
from jaxserve.model.sharding import make_mesh, place
from jaxserve.model.weights import abstract_weights, init_weights
from jaxserve.presets import preset
from jaxserve.request import Request, SamplingParams
from jaxserve.request.batch import StepBatch
from jaxserve.request.step import GroupShape, StepKind, StepLimits, StepPlan, StepRow, StepShape
from jaxserve.runner import Buckets, CompileCounter, ModelRunner, step_limits

CFG = preset("tiny", dtype="float32")


@pytest.fixture(scope="module")
def weights():
    return init_weights(jax.random.key(3), CFG, std=0.15)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (37, 22, 30)]


@pytest.mark.parametrize("tp, ep", [(4, 2), (2, 4)])
def test_sharded_logits_equal_single_device(weights, prompts, tp, ep):
    schedule = chunk_schedule([[13, 24], [5, 17], [30]]) + prefill_then_decode([0, 0, 0], [0, 0, 0])[1:]
    single = run_schedule(weights, CFG, prompts, schedule, (16, 32))
    mesh = make_mesh(tp, ep)
    sharded_weights = place(weights, abstract_weights(CFG), mesh)
    sharded = run_schedule(sharded_weights, CFG, prompts, schedule, (16, 32), mesh=mesh)
    for a, b in zip(single, sharded):
        # Heads split 4 ways sum the output projection in another order: float32 rounding, no more.
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=0)
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
    runner = ModelRunner(
        CFG,
        place(weights, abstract_weights(CFG), mesh),
        geometry,
        mesh,
        Buckets(prefill_rows=(1, 2), prefill_chunks=(16, 32), decode_rows=(1, 2, 4)),
    )
    runner.warmup()
    assert set(runner.times.compile_s) == {prefill(r, c) for r, c in [(1, 16), (1, 32), (2, 16), (2, 32)]} | {
        decode(r) for r in (1, 2, 4)
    }
    before = counter.count
    greedy = SamplingParams(temperature=0.0)
    requests = [
        Request(f"r{i}", p.tolist(), greedy, slot=i, pages=list(range(6 * i, 6 * i + 6))) for i, p in enumerate(prompts)
    ]
    a, b, c = requests

    def run_prefill(*chunks):
        rows = tuple(StepRow.chunk(r, start, n) for r, start, n in chunks)
        result = runner.run(StepBatch.of(StepPlan(prefill=rows)))
        assert result.decode == ()
        for row in rows:  # what scheduling records
            row.request.num_sampled += row.samples_output
        return [out.token_id for out in result.prefill]

    # A varied workload: one and two rows, both chunk buckets, decode batches of 1, 2 and 3 rows.
    first = run_prefill((a, 0, 30))
    second = run_prefill((a, 30, 7), (b, 0, 9))
    third = run_prefill((b, 9, 13), (c, 0, 30))
    for request, token in ((a, second[0]), (b, third[0]), (c, third[1])):
        request.output_ids.append(token)
    for active in ([a], [a, b], [a, b, c], [c]):
        result = runner.run(StepBatch.of(StepPlan.decode_of(active)))
        assert result.prefill == () and len(result.decode) == len(active)
        for request, out in zip(active, result.decode):
            request.output_ids.append(out.token_id)
            request.num_sampled += 1
    assert counter.count == before, "a call after warm-up compiled"
    assert len(first) == 1 and 0 <= first[0] < CFG.vocab_size
    too_long = Request("long", [1] * 33, greedy, slot=3, pages=[18])
    with pytest.raises(ValueError, match="no compiled prefill step holds them"):
        runner.run(StepBatch.of(StepPlan(prefill=(StepRow.chunk(too_long, 0, 33),))))


def prefill(rows: int, chunk: int) -> StepShape:
    return StepShape(prefill=GroupShape(rows, chunk))


def decode(rows: int) -> StepShape:
    return StepShape(decode=GroupShape(rows, 1))


def mixed(rows: int, chunk: int, decode_rows: int) -> StepShape:
    return StepShape(GroupShape(rows, chunk), GroupShape(decode_rows, 1))


def test_buckets_compile_what_one_request_needs_first_and_one_mixed_shape_per_one_row_prefill_shape():
    buckets = Buckets.for_limits(max_prefill_rows=2, chunked_prefill_size=256, max_num_seqs=8, mixed=True)
    shapes = buckets.shapes()
    assert shapes[:2] == buckets.first_shapes() == [prefill(1, 16), decode(1)]
    assert len(shapes) == len(set(shapes)) == 6 + 4 + 3  # prefill, decode, mixed (every decode row in each)
    # A mixed step holds a pure chunk's tokens: one chunk, shortened by its decode rows (all 8, padded).
    assert {s for s in shapes if s.kind is StepKind.MIXED} == {mixed(1, c - 8, 8) for c in (16, 64, 256)}
    assert buckets.prompt_shapes(40) == [prefill(1, 64), decode(1)] and buckets.prompt_shapes(999)[0] == prefill(1, 256)
    # A chunk no longer than the decode rows has no mixed form.
    narrow = Buckets.for_limits(max_prefill_rows=1, chunked_prefill_size=64, max_num_seqs=16, mixed=True)
    assert {s for s in narrow.shapes() if s.kind is StepKind.MIXED} == {mixed(1, 48, 16)}
    # Verify rows (k = 2 drafts) carry 3 tokens each: the chunk leaves 8 x 3 (and a 16-token chunk has no mixed form).
    drafting = Buckets.for_limits(2, 256, 8, mixed=True, decode_row_tokens=3)
    assert {s for s in drafting.shapes() if s.kind is StepKind.MIXED} == {mixed(1, c - 24, 8) for c in (64, 256)}
    engine = EngineConfig(max_num_seqs=8, speculative_config=SpeculativeConfig("mtp", 2))
    assert Buckets.for_config(engine).decode_row_tokens == 3


def test_step_limits_grow_with_the_compiled_shapes():
    buckets = Buckets.for_limits(max_prefill_rows=2, chunked_prefill_size=256, max_num_seqs=8, mixed=True)
    compiled = set()
    assert step_limits(compiled, buckets) is None
    compiled |= {prefill(1, 16)}
    assert step_limits(compiled, buckets) is None  # no decode shape yet
    compiled |= {decode(1)}
    assert step_limits(compiled, buckets) == StepLimits(16, 1, 1)
    compiled |= {decode(2), decode(4), prefill(1, 64), prefill(2, 16)}
    # Two rows only where a two-row shape holds the longest chunk one row may have.
    assert step_limits(compiled, buckets) == StepLimits(64, 1, 4)
    compiled |= {prefill(2, 64)}
    assert step_limits(compiled, buckets) == StepLimits(64, 2, 4)
    compiled |= {mixed(1, 8, 8)}
    assert not step_limits(compiled, buckets).mixed  # (1, 64) has no mixed form yet
    compiled |= {mixed(1, 56, 8)}
    assert step_limits(compiled, buckets) == StepLimits(64, 2, 4, mixed_decode_rows=8)


def test_a_top_k_row_takes_the_sampler_that_sorts_and_a_batch_without_cuts_the_one_that_does_not(weights, prompts):
    """Only a batch with a top-k or top-p row sorts the vocabulary (a sampler compiled apart, both at warm-up): at
    temperature 10, a top_k=1 row still gives the greedy tokens, which it would not through the sampler that skips
    the cut; a temperature-10 row without a cut spreads over the vocabulary."""
    counter = CompileCounter()
    geometry = CacheGeometry(num_slots=2, num_pages=12, page_size=8, max_pages_per_seq=6)
    runner = ModelRunner(CFG, weights, geometry, make_mesh(1, 1), Buckets((1,), (32,), (2,)))
    runner.warmup()
    before = counter.count
    hot = dict(temperature=10.0, seed=5)
    kinds = {"greedy": SamplingParams(temperature=0.0), "top_k": SamplingParams(top_k=1, **hot)}
    kinds["hot"] = SamplingParams(**hot)
    tokens = {}
    for name, params in kinds.items():
        request = Request(name, prompts[0][:20].tolist(), params, slot=0, pages=list(range(6)))
        row = StepRow.chunk(request, 0, 20)
        tokens[name] = [runner.run(StepBatch.of(StepPlan(prefill=(row,)))).prefill[0].token_id]
        request.num_sampled += 1
        for _ in range(5):
            request.output_ids.append(tokens[name][-1])
            tokens[name].append(runner.run(StepBatch.of(StepPlan.decode_of([request]))).decode[0].token_id)
            request.num_sampled += 1
    assert counter.count == before, "a call after warm-up compiled"
    assert tokens["top_k"] == tokens["greedy"]
    assert tokens["hot"] != tokens["greedy"]
    # The public view of a shape's executables (benchmarks profile them): the forward, the sampler without the sort,
    # the one with it.
    forward, plain, sorting = runner.executables(StepShape(decode=GroupShape(2, 1)))
    sorts = [len(re.findall(r"= \S+ sort\(", compiled.as_text())) for compiled in (forward, plain, sorting)]
    assert sorts[0] == sorts[1] == 0 and sorts[2] > 0, sorts  # sort instructions in the optimized HLO
