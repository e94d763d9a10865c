"""The engine loop on the tiny model: interleaving read from the step record, batch invariance under a random
workload with aborts, no leaked pages, failing steps, and the log showing forced decodes."""

from __future__ import annotations

import logging
import random

import jax
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine import Engine, build_runner
from jaxserve.model.weights import abstract_weights, init_weights
from jaxserve.presets import preset
from jaxserve.scheduler import SamplingParams
from jaxserve.sharding import make_mesh, place

CFG = preset("tiny", dtype="float32")
CHUNK = 16


def engine_config(**overrides) -> EngineConfig:
    base = dict(max_num_seqs=4, chunked_prefill_size=CHUNK, max_prefill_rows=2, page_size=8, max_model_len=400,
                num_kv_pages=120, decode_log_interval=1000)
    return EngineConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def runner():
    mesh = make_mesh(1, 1, jax.devices()[:1])
    weights = place(init_weights(jax.random.key(5), CFG, std=0.15), abstract_weights(CFG), mesh)
    runner = build_runner(engine_config(), CFG, weights, mesh)
    runner.warmup()
    return runner


def make_engine(runner, **overrides) -> Engine:
    return Engine(engine_config(**overrides), CFG, runner)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, CFG.vocab_size, n).tolist()


def burst(engine: Engine, attacker: str) -> str:
    """The engine's own step record from the attacker's first chunk to its last: P prefill, D decode."""
    record = list(engine.step_record)
    prefills = [i for i, r in enumerate(record) if r.kind == "prefill" and attacker in r.request_ids]
    return "".join(r.kind[0].upper() for r in record[prefills[0]:prefills[-1] + 1])


ATTACKER_CHUNKS = 25  # not a multiple of 2, 3 or 8, so the last chunk is not itself followed by a due decode


@pytest.mark.parametrize("every", [None, 2, 3, 8])
def test_victim_decodes_during_a_long_prefill_only_with_the_flag(runner, every):
    engine = make_engine(runner, decode_interleave_every=every)
    victim = engine.submit(prompt(5, 1), greedy(60), request_id="victim")
    # The first prefill step carries the victim's 5 tokens and the attacker's first 11: 1 + 24 full chunks.
    attacker = engine.submit(prompt(11 + 24 * CHUNK, 2), greedy(2), request_id="attacker")
    engine.start()
    try:
        victim_tokens, victim_reason, _ = victim.wait(timeout=120)
        attacker_tokens, _, _ = attacker.wait(timeout=120)
    finally:
        engine.shutdown()
    steps = burst(engine, "attacker")
    chunks, decodes = steps.count("P"), steps.count("D")
    assert chunks == ATTACKER_CHUNKS
    assert len(victim_tokens) == 60 and victim_reason == "length" and len(attacker_tokens) == 2
    if every is None:
        assert steps == "P" * ATTACKER_CHUNKS  # prefill-first: the victim is frozen for the whole burst
    else:
        assert decodes >= chunks // every
        # Exactly where the policy puts them: one decode after every N prefill steps, none elsewhere.
        assert steps == ("P" * every + "D") * (chunks // every) + "P" * (chunks % every)
        assert engine.stats()["forced_decode_steps"] == sum(r.forced for r in engine.step_record) >= decodes
    assert engine.stats()["free_pages"] == engine.page_pool.num_pages


def test_random_workload_matches_running_each_request_alone_and_returns_every_page(runner):
    rng = random.Random(0)
    specs = [(prompt(rng.randint(1, 70), 100 + i), rng.randint(1, 12)) for i in range(10)]
    alone = []
    engine = make_engine(runner).start()
    try:
        for ids, max_tokens in specs:
            alone.append(engine.submit(ids, greedy(max_tokens)).wait(timeout=60)[0])
    finally:
        engine.shutdown()

    engine = make_engine(runner, decode_interleave_every=2)
    handles = [engine.submit(ids, greedy(n), request_id=f"r{i}") for i, (ids, n) in enumerate(specs)]
    doomed = [engine.submit(prompt(60, 900 + i), greedy(30), request_id=f"doomed{i}") for i in range(3)]
    for h in doomed[:2]:
        engine.abort(h.request_id)  # aborted before it ever runs
    engine.start()
    try:
        engine.abort(doomed[2].request_id)  # aborted while the workload runs
        results = [h.wait(timeout=120) for h in handles]
        doomed_results = [h.wait(timeout=120) for h in doomed]
    finally:
        engine.shutdown()
    assert [tokens for tokens, _, _ in results] == alone
    assert all(reason == "length" for _, reason, _ in results)
    assert [reason for _, reason, _ in doomed_results] == ["abort"] * 3
    stats = engine.stats()
    assert stats["free_pages"] == engine.page_pool.num_pages and stats["running"] == 0 and stats["waiting"] == 0
    assert engine.scheduler.prefill_manager.slots.num_free == engine.config.max_num_seqs


def test_a_failing_step_fails_its_batch_and_the_engine_keeps_serving(runner, monkeypatch):
    engine = make_engine(runner)
    real_prefill = runner.prefill

    def flaky_prefill(rows):
        if any(list(row.tokens[:3]) == [7, 7, 7] for row in rows):
            raise RuntimeError("injected failure")
        return real_prefill(rows)

    monkeypatch.setattr(runner, "prefill", flaky_prefill)
    engine.start()
    try:
        bad = engine.submit([7, 7, 7, 7], greedy(4)).wait(timeout=60)
        good = engine.submit(prompt(9, 3), greedy(4)).wait(timeout=60)
    finally:
        engine.shutdown()
    assert bad[1] == "error" and "injected failure" in bad[2] and bad[0] == []
    assert good[1] == "length" and len(good[0]) == 4
    assert engine.stats()["free_pages"] == engine.page_pool.num_pages


def test_requests_that_can_never_fit_are_refused_at_submit(runner):
    engine = make_engine(runner)
    with pytest.raises(ValueError, match="exceeds max_model_len=400"):
        engine.submit(prompt(390, 1), greedy(20))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([1, CFG.vocab_size], greedy(2))


def test_the_log_shows_forced_decodes(runner, caplog):
    engine = make_engine(runner, decode_interleave_every=2)
    handles = [engine.submit(prompt(3, 1), greedy(10)), engine.submit(prompt(6 * CHUNK, 2), greedy(1))]
    with caplog.at_level(logging.INFO, logger="jaxserve.engine"):
        engine.start()
        try:
            for handle in handles:
                handle.wait(timeout=60)
        finally:
            engine.shutdown()
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("Prefill batch") for line in lines) == engine.stats()["prefill_steps"]
    assert any(line.startswith("Decode batch (interleaved after 2 prefill steps)") for line in lines)


def test_a_stall_budget_tighter_than_any_step_alternates_without_starving_prefill(runner):
    engine = make_engine(runner, max_decode_stall_ms=0.01)  # 10 us: every prefill step breaks it
    victim = engine.submit(prompt(5, 1), greedy(40), request_id="victim")
    attacker = engine.submit(prompt(11 + 8 * CHUNK, 2), greedy(2), request_id="attacker")
    engine.start()
    try:
        victim.wait(timeout=120)
        attacker_tokens, _, _ = attacker.wait(timeout=120)
    finally:
        engine.shutdown()
    steps = burst(engine, "attacker")
    assert steps == "PD" * 8 + "P"  # a decode after every chunk, and the prompt still completes
    assert len(attacker_tokens) == 2
    assert engine.stats()["stall_decode_steps"] == sum(r.forced for r in engine.step_record) >= 8


@pytest.fixture(scope="module")
def mixed_runner():
    mesh = make_mesh(1, 1, jax.devices()[:1])
    weights = place(init_weights(jax.random.key(5), CFG, std=0.15), abstract_weights(CFG), mesh)
    runner = build_runner(MIXED, CFG, weights, mesh)
    runner.warmup()
    return runner


MIXED = engine_config(max_num_seqs=2, max_prefill_rows=1, mixed_batches=True)


def test_mixed_batches_advance_running_requests_every_step_with_unchanged_outputs(mixed_runner):
    specs = {"victim": (prompt(5, 1), 30), "attacker": (prompt(100, 2), 3)}
    engine = Engine(MIXED, CFG, mixed_runner).start()
    try:
        alone = {name: engine.submit(ids, greedy(n)).wait(timeout=60)[0] for name, (ids, n) in specs.items()}
    finally:
        engine.shutdown()
    assert "mixed" not in {r.kind for r in engine.step_record}  # alone, nobody rides along

    engine = Engine(MIXED, CFG, mixed_runner)
    handles = {name: engine.submit(ids, greedy(n), request_id=name) for name, (ids, n) in specs.items()}
    engine.start()
    try:
        together = {name: handle.wait(timeout=60)[0] for name, handle in handles.items()}
    finally:
        engine.shutdown()
    assert together == alone
    attacker_steps = [r for r in engine.step_record if "attacker" in r.request_ids and r.kind != "decode"]
    # The victim prefilled alone (one prompt per step); then every attacker chunk carried the victim's token,
    # in a 16-token budget that the decode row shares: 15 prompt tokens per step.
    assert [r.kind for r in attacker_steps] == ["mixed"] * 7
    assert all("victim" in r.request_ids and r.num_tokens == 16 for r in attacker_steps[:-1])
    assert engine.stats()["mixed_steps"] == 7 and engine.stats()["free_pages"] == engine.page_pool.num_pages
