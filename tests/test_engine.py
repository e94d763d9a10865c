"""The engine loop, mostly over the fake runner (tests/fake_runner.py: no compiling, hand-computable tokens):
interleaving read from the step record, admission naming the field, EOS and stop tokens, failing steps, no leaked
pages or slots. Two end-to-end tests run the tiny model itself: batch invariance under a random workload with
aborts, and mixed batches."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
import time

import jax
import numpy as np
import pytest
from fake_runner import FakeRunner, continuation

from jaxserve.config import EngineConfig
from jaxserve.engine import Engine, EngineDraining, QueueFull
from jaxserve.model.cache import kv_geometry
from jaxserve.model.sharding import make_mesh, place
from jaxserve.model.weights import abstract_weights, init_weights
from jaxserve.presets import preset
from jaxserve.request import InvalidRequest, SamplingParams
from jaxserve.request.step import StepKind, StepLimits
from jaxserve.runner import Buckets, build_runner

CFG = preset("tiny", dtype="float32")
CHUNK = 16
EOS = (1,)


def engine_config(**overrides) -> EngineConfig:
    base = dict(
        max_num_seqs=4,
        chunked_prefill_size=CHUNK,
        max_prefill_rows=2,
        page_size=8,
        max_model_len=400,
        num_kv_pages=120,
        decode_log_interval=1000,
    )
    return EngineConfig(**{**base, **overrides})


def fake_engine(eos=EOS, **overrides) -> Engine:
    cfg = engine_config(**overrides)
    return Engine(cfg, CFG, FakeRunner(kv_geometry(cfg, CFG), Buckets.for_config(cfg), CFG.vocab_size), eos)


@pytest.fixture(scope="module")
def runner():
    mesh = make_mesh(1, 1, jax.devices()[:1])
    weights = place(init_weights(jax.random.key(5), CFG, std=0.15), abstract_weights(CFG), mesh)
    runner = build_runner(engine_config(mixed_batches=False), CFG, weights, mesh)
    runner.warmup()
    return runner


def make_engine(runner, **overrides) -> Engine:
    """An engine over the module's runner, which compiles no mixed steps (the mixed ones have their own runner)."""
    return Engine(engine_config(**{"mixed_batches": False, **overrides}), CFG, runner, EOS)


def greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, CFG.vocab_size, n).tolist()


def run(engine: Engine, *handles, timeout: float = 60):
    """Start the engine, wait for every handle, shut down; the (tokens, reason, error) of each."""
    engine.start()
    try:
        return [h.wait(timeout=timeout) for h in handles]
    finally:
        engine.shutdown()


def assert_nothing_leaked(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.free_pages == engine.pages.pages.size and stats.running == 0 and stats.waiting == 0
    # Every page in use is one the prefix cache keeps for later, and nobody holds it.
    assert engine.pages.pages.num_used == engine.pages.num_cached and engine.pages.num_held == 0
    assert engine.scheduler.prefill_manager.slots.num_free == engine.config.max_num_seqs
    assert not engine.scheduler.has_work


def burst(engine: Engine, attacker: str) -> str:
    """The engine's own step record from the attacker's first chunk to its last: P prefill, D decode, M mixed."""
    record = list(engine.step_record)
    prefills = [i for i, r in enumerate(record) if r.kind is not StepKind.DECODE and attacker in r.request_ids]
    return "".join(r.kind.value[0].upper() for r in record[prefills[0] : prefills[-1] + 1])


ATTACKER_CHUNKS = 25  # not a multiple of 2, 3 or 8, so the last chunk is not itself followed by a due decode


@pytest.mark.parametrize("every", [None, 2, 3, 8])
def test_victim_decodes_during_a_long_prefill_only_with_the_flag(every):
    """--decode-interleave-every N keeps the seed's exact semantics (pure prefill steps, a decode after every N);
    without it, --no-mixed-batches is prefill-first."""
    engine = fake_engine(
        step_policies={"decode_interleave_every": every}, mixed_batches=False if every is None else None
    )
    victim = engine.submit(prompt(5, 1), greedy(60), request_id="victim")
    # The first prefill step carries the victim's 5 tokens and the attacker's first 11: 1 + 24 full chunks.
    attacker = engine.submit(prompt(11 + 24 * CHUNK, 2), greedy(2), request_id="attacker")
    (victim_tokens, victim_reason, _), (attacker_tokens, _, _) = run(engine, victim, attacker)
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
        assert (
            engine.stats().steps.forced["interleave"]
            == sum(r.forced_by == "interleave" for r in engine.step_record)
            >= decodes
        )
    assert victim_tokens == continuation(prompt(5, 1), 60, CFG.vocab_size)
    assert_nothing_leaked(engine)


def expected_output(ids: list[int], sampling: SamplingParams, eos: tuple[int, ...]) -> tuple[list[int], str]:
    """What the fake model's continuation gives under these stop rules (the tokens up to and with the stop)."""
    out = continuation(ids, sampling.max_tokens, CFG.vocab_size)
    for i, token in enumerate(out):
        if (token in eos and not sampling.ignore_eos) or token in sampling.stop_token_ids:
            return out[: i + 1], "stop"
    return out, "length"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_random_workload_gives_each_request_its_own_continuation_and_leaks_nothing(async_scheduling):
    """Many requests of different lengths, stop tokens, EOS, max_tokens 1, aborts before and during the run, every
    policy, with and without a step in flight: each output is what the fake model gives that prompt alone (so both
    loops give identical outputs), no token is delivered after a request's last, and every page and slot comes
    back."""
    rng = random.Random(1)
    for flags in (
        {},
        {"mixed_batches": False},
        {"step_policies": {"decode_interleave_every": 2}},
        {"step_policies": {"max_decode_stall_ms": 1e-6}},
    ):
        engine = fake_engine(async_scheduling=async_scheduling, **flags)
        specs = []
        for i in range(24):
            ids, n = prompt(rng.randint(1, 90), i), rng.choice([1, 1, rng.randint(2, 20)])
            future = continuation(ids, n, CFG.vocab_size)
            kind = rng.choice(["plain", "stop token", "eos"])
            stop = [future[rng.randrange(n)]] if kind == "stop token" else []
            specs.append(
                (ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=kind != "eos", stop_token_ids=stop))
            )
        # The EOS ids: tokens of some continuations, so some requests stop early on them.
        eos = tuple({continuation(ids, s.max_tokens, CFG.vocab_size)[-1] for ids, s in specs[::5]})
        engine.eos_token_ids = frozenset(eos)
        handles = [engine.submit(ids, sampling, request_id=f"r{i}") for i, (ids, sampling) in enumerate(specs)]
        doomed = [engine.submit(prompt(60, 900 + i), greedy(30), request_id=f"doomed{i}") for i in range(3)]
        engine.abort("doomed0")  # before it ever runs
        # While the workload runs (from inside a step, so it lands at the next step boundary, however fast).
        engine.runner.fail = lambda batch, engine=engine: (
            engine.abort("doomed1") if len(engine.runner.steps) == 10 else None
        )
        engine.start()
        try:
            results = [h.wait(timeout=60) for h in handles]
            engine.abort("doomed2")
            doomed_results = [h.wait(timeout=60) for h in doomed]
        finally:
            engine.shutdown()
        doomed_reasons = [reason for _, reason, _ in doomed_results]
        expected = [expected_output(ids, sampling, eos) for ids, sampling in specs]
        assert [r[:2] for r in results] == expected, flags
        assert doomed_reasons[:2] == ["abort", "abort"] and doomed_reasons[2] in ("abort", "length")
        delivered = sum(len(tokens) for tokens, _ in expected)
        # Nothing is counted past a request's end (a token computed for it by a step in flight is dropped).
        assert engine.stats().generation_tokens == delivered + sum(len(t) for t, _, _ in doomed_results)
        sampled = collections.Counter(  # by prompt: each request's is its own
            row.prompt for b in engine.runner.steps for row in b.prefill + b.decode if row.samples_output
        )
        computed_past_the_end = sum(sampled[tuple(ids)] - len(tokens) for (ids, _), (tokens, _) in zip(specs, expected))
        # Only a step in flight computes past a stop (max_tokens is never overrun: it is known when scheduling).
        assert computed_past_the_end > 0 if async_scheduling else computed_past_the_end == 0, computed_past_the_end
        assert sum(engine.stats().finished.values()) == 27
        assert_nothing_leaked(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_loop_never_idles_while_there_is_work(async_scheduling):
    """The loop waits for new work only when there is none. With a step in flight, an iteration may schedule nothing
    and only land a step, and that landing can make work: here, the request it finishes frees the one slot the next
    request waits for."""
    engine = fake_engine(max_num_seqs=1, async_scheduling=async_scheduling)
    idle_with_work = []
    wait = engine._wake.wait

    def recording_wait(timeout=None):
        idle_with_work.append(engine.scheduler.has_work)
        return wait(timeout)

    engine._wake.wait = recording_wait
    specs = [(prompt(20, i), 4) for i in range(3)]
    handles = [engine.submit(ids, greedy(n)) for ids, n in specs]
    engine.start()
    try:
        results = [h.wait(timeout=60) for h in handles]
        deadline = time.monotonic() + 10
        while not idle_with_work and time.monotonic() < deadline:  # the loop goes idle once all is done
            time.sleep(0.01)
    finally:
        engine.shutdown()
    assert [r[0] for r in results] == [continuation(ids, n, CFG.vocab_size) for ids, n in specs]
    assert idle_with_work and not any(idle_with_work)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_completed_prompt_decodes_in_the_very_next_step(async_scheduling):
    """Its first token stays on the device, in its slot, so the step dispatched while its last chunk still runs can
    already decode it: with a step in flight, the second token is not held back a step behind the first."""
    engine = fake_engine(max_num_seqs=4, max_prefill_rows=1, mixed_batches=True, async_scheduling=async_scheduling)
    specs = [(prompt(5 + 2 * CHUNK * i, i), 8) for i in range(4)]  # 1, 3, 5 and 7 chunks, queued behind each other
    results = run(engine, *[engine.submit(ids, greedy(n), request_id=f"r{i}") for i, (ids, n) in enumerate(specs)])
    assert [r[0] for r in results] == [continuation(ids, n, CFG.vocab_size) for ids, n in specs]
    steps = engine.runner.steps
    for i, (ids, _) in enumerate(specs):
        last_chunk = next(
            k for k, b in enumerate(steps) if any(c.samples_output and c.prompt == tuple(ids) for c in b.prefill)
        )
        assert tuple(ids) in [r.prompt for r in steps[last_chunk + 1].decode], (i, last_chunk)
    assert_nothing_leaked(engine)


def test_steps_stay_within_the_shapes_compiled_so_far_while_the_rest_compile():
    """Serving starts with the smallest prefill chunk and one decode row compiled; as more shapes compile, steps
    grow. The fake runner asserts that no step exceeds what is compiled when it is dispatched."""
    engine = fake_engine(max_num_seqs=4, mixed_batches=True, async_scheduling=True)
    full = engine.runner.limits()
    engine.runner._limits = StepLimits(
        prefill_tokens=min(engine.runner.buckets.prefill_chunks), prefill_rows=1, decode_rows=1
    )
    grown = {20: dataclasses.replace(full, prefill_rows=1, decode_rows=2, mixed_decode_rows=0), 60: full}

    def compile_more(batch):
        engine.runner._limits = grown.get(len(engine.runner.steps), engine.runner._limits)

    engine.runner.fail = compile_more
    specs = [(prompt(40 + 7 * i, i), 30) for i in range(8)]
    results = run(engine, *[engine.submit(ids, greedy(n)) for ids, n in specs])
    assert [r[0] for r in results] == [continuation(ids, n, CFG.vocab_size) for ids, n in specs]
    steps = engine.runner.steps
    assert max(len(b.decode) for b in steps[:20]) == 1 and max(c.length for b in steps[:20] for c in b.prefill) == 16
    assert max(len(b.decode) for b in steps[20:60]) == 2
    assert max(len(b.decode) for b in steps[61:]) > 2 and any(b.mixed for b in steps[61:])
    assert_nothing_leaked(engine)


def test_random_workload_matches_running_each_request_alone_and_returns_every_page(runner):
    """On the tiny model itself: each request alone through the synchronous loop, then all together with aborts
    through the overlapped loop (one step in flight), give the same greedy tokens."""
    rng = random.Random(0)
    specs = [(prompt(rng.randint(1, 70), 100 + i), rng.randint(1, 12)) for i in range(10)]
    alone = []
    engine = make_engine(runner, async_scheduling=False).start()
    try:
        for ids, max_tokens in specs:
            alone.append(engine.submit(ids, greedy(max_tokens)).wait(timeout=60)[0])
    finally:
        engine.shutdown()

    engine = make_engine(runner, step_policies={"decode_interleave_every": 2}, async_scheduling=True)
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
    assert_nothing_leaked(engine)


@pytest.fixture(scope="module")
def sharded_fp8_runner():
    """TP 2 x EP 4 over the 8 fake devices, fp8 KV; only the shapes that serve one request at a time."""
    mesh = make_mesh(2, 4)
    weights = place(init_weights(jax.random.key(5), CFG, std=0.15), abstract_weights(CFG), mesh)
    cfg = engine_config(mixed_batches=False, kv_cache_dtype="fp8", tensor_parallel_size=2, expert_parallel_size=4)
    runner = build_runner(cfg, CFG, weights, mesh)
    runner.warmup(runner.buckets.first_shapes())
    return runner


@pytest.mark.parametrize("which", ["runner", "sharded_fp8_runner"])
def test_prefix_cache_hits_give_the_tokens_and_logprobs_of_prefilling_everything(which, request):
    """On the tiny model (page 8 = its window, chunks of 16; also over TP 2 x EP 4 with fp8 KV): prompts that share
    a prefix with earlier ones ending inside a page, exactly at a page boundary, shorter than the window, across
    several chunks (a hit then starts from a snapshot taken mid-chunk) and a whole repeated prompt, one after the
    other through the overlapped loop so each finds what the ones before left: the same greedy tokens and logprobs
    (within 1e-5) with the prefix cache as without it. (With fp8 KV that holds because a chunk sees its own tokens'
    K=V at the stored precision too: before, where a chunk started moved the logprobs by fp8's rounding.)"""
    runner = request.getfixturevalue(which)
    base = prompt(90, 7)
    tail = [prompt(n, 300 + n) for n in range(1, 12)]
    trace = [
        base[:41],  # the first: nothing cached
        base[:21] + tail[0],  # shares 21 tokens: ends inside page 2
        base[:24] + tail[1],  # shares exactly 3 pages
        base[:5] + tail[2],  # shares less than the window
        base[:60] + tail[3],  # shares 41 with the first: a hit on the snapshot taken at 40, inside its last chunk
        base[:41],  # the first again: a hit on its pages but the last
        base[:90],
        base[:90] + tail[4],
    ]
    outputs = {}
    for caching in (False, True):
        engine = make_engine(
            runner, enable_prefix_caching=caching, async_scheduling=True, kv_cache_dtype=runner.geometry.kv_cache_dtype
        ).start()
        try:
            logprobs = []
            for i, ids in enumerate(trace):
                handle = engine.submit(ids, greedy(5, logprobs=3), request_id=f"t{i}")
                logprobs.append([lp for event in handle.sync_events(timeout=60) for lp in event.logprobs or ()])
        finally:
            engine.shutdown()
        outputs[caching] = logprobs
        hits = engine.stats().prefix_cache.hits
        assert (hits > 0) == caching, hits
        assert_nothing_leaked(engine)
    # The repeated first prompt finds its 5 full pages but the last (its last token must run): 32 tokens.
    assert hits >= 32 + 24 + 16 + 40 + 88
    for plain, cached in zip(outputs[False], outputs[True]):
        assert len(plain) == 5 and [lp.token_id for lp in plain] == [lp.token_id for lp in cached]
        assert [[t for t, _ in lp.top] for lp in plain] == [[t for t, _ in lp.top] for lp in cached]
        np.testing.assert_allclose(
            [[v for _, v in lp.top] for lp in cached], [[v for _, v in lp.top] for lp in plain], atol=1e-5
        )


def test_a_thousand_requests_on_shared_prefixes_never_write_a_shared_page_and_leak_nothing():
    """1,000 requests whose prompts start with one of a few long prefixes (cut anywhere, so hits end on all sorts
    of boundaries), some aborted while they run, over a small pool and few snapshots (so pages and snapshots are
    evicted): each output is still the fake model's continuation of its own prompt (a hit that resumed the wrong
    state, or read a page written since, would change it), no step writes a page the cache shared before it, the
    prefix cache's books balance before every step, and every page and slot comes back."""
    engine = fake_engine(num_kv_pages=90, prefix_cache_snapshots=3, max_model_len=200)
    shared_writes = []
    registered: dict[int, object] = {}  # page -> its cache record, as of the step before
    dispatch = engine.runner.dispatch

    def checked(batch):  # on the engine thread, between steps
        size = engine.geometry.page_size
        for group in batch.groups:
            for slot, start, length, pages in zip(group.slots, group.positions, group.lengths, group.page_table):
                for page in pages[start // size : (start + length - 1) // size + 1]:
                    if registered.get(page) is not None and registered[page] is engine.pages.cached(page):
                        shared_writes.append((slot, page))
        registered.clear()
        registered.update({p: engine.pages.cached(p) for p in range(engine.geometry.num_pages)})
        engine.pages.check_books()
        return dispatch(batch)

    engine.runner.dispatch = checked
    rng = random.Random(4)
    bases = [prompt(120, 60 + i) for i in range(4)]
    engine.start()
    try:
        for wave in range(20):
            specs, handles = [], []
            for i in range(50):
                ids = rng.choice(bases)[: rng.randint(1, 120)] + prompt(rng.randint(0, 12), 5000 + 50 * wave + i)
                specs.append((ids, rng.randint(1, 8)))
                handles.append(engine.submit(ids, greedy(specs[-1][1]), request_id=f"w{wave}-{i}"))
            for handle in handles[::9]:
                engine.abort(handle.request_id)
            for (ids, n), handle in zip(specs, handles):
                tokens, reason, _ = handle.wait(timeout=60)
                if reason != "abort":
                    assert tokens == continuation(ids, n, CFG.vocab_size), handle.request_id
    finally:
        engine.shutdown()
    stats = engine.stats().prefix_cache
    assert not shared_writes, shared_writes[:5]
    assert stats.hits > 0, stats
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failing_step_fails_its_batch_and_the_engine_keeps_serving(async_scheduling):
    engine = fake_engine(async_scheduling=async_scheduling)
    engine.runner.fail = lambda batch: (
        RuntimeError("injected failure")
        if batch.prefill is not None and any(row[:3].tolist() == [7, 7, 7] for row in batch.prefill.tokens)
        else None
    )
    bad, good = engine.submit([7, 7, 7, 7], greedy(4)), engine.submit(prompt(9, 3), greedy(4))
    engine.start()
    try:
        bad, good = bad.wait(timeout=60), good.wait(timeout=60)  # one prefill step holds both
        after = engine.submit(prompt(9, 4), greedy(4)).wait(timeout=60)
    finally:
        engine.shutdown()
    assert bad[1] == good[1] == "error" and "injected failure" in bad[2] and bad[0] == []
    assert after[1] == "length" and after[0] == continuation(prompt(9, 4), 4, CFG.vocab_size)
    assert engine.stats().finished == {"error": 2, "length": 1}
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_that_cannot_start_fails_after_the_step_before_it_delivered(async_scheduling):
    """Decode steps raise at dispatch. With a step in flight, the first decode is dispatched while the prompt's step
    still runs; its failure must not overtake that step: the client gets the first token, then the error. (Without
    mixed steps, so the second prompt's chunk carries no decode row.)"""
    engine = fake_engine(async_scheduling=async_scheduling, mixed_batches=False)
    real = engine.runner.dispatch

    def dispatch(batch):
        if batch.decode:
            raise RuntimeError("injected dispatch failure")
        return real(batch)

    engine.runner.dispatch = dispatch
    specs = [(prompt(5, 1), 4), (prompt(20, 2), 4)]
    results = run(engine, *[engine.submit(ids, greedy(n)) for ids, n in specs])
    assert [r[0] for r in results] == [continuation(ids, 1, CFG.vocab_size) for ids, _ in specs]
    assert all(r[1] == "error" and "injected dispatch failure" in r[2] for r in results)
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failure_that_loses_the_donated_cache_fails_every_running_request_and_resets_it(async_scheduling):
    engine = fake_engine(async_scheduling=async_scheduling)
    engine.runner.lose_cache_on_failure = True
    engine.runner.fail = lambda batch: (
        RuntimeError("device lost")
        if batch.prefill is not None and prompt(5, 2) in batch.prefill.tokens.tolist()
        else None
    )
    streaming = engine.submit(prompt(5, 1), greedy(390), request_id="streaming")
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while len(engine.runner.steps) < 5 and time.monotonic() < deadline:  # streaming is decoding
            time.sleep(0.001)
        late = engine.submit(prompt(5, 2), greedy(3), request_id="late")
        results = streaming.wait(timeout=60), late.wait(timeout=60)
        engine.runner.fail = None
        after = engine.submit(prompt(9, 4), greedy(4)).wait(timeout=60)
    finally:
        engine.shutdown()
    assert [r[1] for r in results] == ["error", "error"] and "device lost" in results[0][2]
    assert after[0] == continuation(prompt(9, 4), 4, CFG.vocab_size)  # a fresh cache, not the lost one
    assert_nothing_leaked(engine)


@pytest.mark.parametrize(
    "prompt_ids, sampling, param, message",
    [
        (prompt(390, 1), greedy(20), "max_tokens", "maximum context length is 400 tokens"),
        (prompt(400, 1), greedy(1), "prompt", "(parameter=prompt, value=400)"),
        ([1, CFG.vocab_size], greedy(2), "prompt", "prompt[1]: token id 96 is outside the vocabulary [0, 96)"),
        ([1, -1], greedy(2), "prompt", "prompt[1]: token id -1"),
        (
            [1, CFG.vocab_size, 2, -1],
            greedy(2),
            "prompt",
            "prompt[1], prompt[3]: token ids 96, -1 are outside the vocabulary [0, 96)",
        ),
        ([5], greedy(2, allowed_token_ids=[3, 96, 4, 97]), "allowed_token_ids", "allowed_token_ids[1], allowed_to"),
        ([], greedy(2), "prompt", "prompt: must not be empty"),
        ([5], greedy(2, stop_token_ids=[3, 500]), "stop_token_ids", "stop_token_ids[1]: token id 500"),
    ],
)
def test_admission_refuses_at_submit_naming_the_field(prompt_ids, sampling, param, message):
    engine = fake_engine()
    with pytest.raises(InvalidRequest) as refused:
        engine.submit(prompt_ids, sampling)
    assert refused.value.param == param and message in str(refused.value)
    assert engine._inbox.empty()


def test_the_context_limit_is_the_smaller_of_max_model_len_and_the_kv_pool():
    engine = fake_engine(max_model_len=400, num_kv_pages=30, page_size=8)  # the pool holds 240 tokens in all
    assert engine.context_limit == 240
    with pytest.raises(InvalidRequest, match="maximum context length is 240 tokens"):
        engine.submit(prompt(200, 1), greedy(41))
    engine.submit(prompt(200, 1), greedy(40))


def test_the_queue_bound_and_draining_refuse_with_their_own_errors():
    engine = fake_engine(max_queued_requests=2)
    engine.submit([5], greedy(2), request_id="a")
    engine.submit([5], greedy(2), request_id="b")
    with pytest.raises(QueueFull, match="max_queued_requests=2"):
        engine.submit([5], greedy(2))
    with pytest.raises(InvalidRequest, match="'a' is already running"):
        engine.submit([5], greedy(2), request_id="a")
    engine.start()
    try:
        assert engine.drain(timeout=30) == 0  # both finished within the drain
        with pytest.raises(EngineDraining):
            engine.submit([5], greedy(2))
    finally:
        engine.shutdown()
    assert engine.stats().finished == {"length": 2}
    assert_nothing_leaked(engine)


def test_generation_stops_on_any_eos_id_and_on_stop_tokens_naming_them():
    vocab = CFG.vocab_size
    p1, p2 = prompt(7, 1), prompt(9, 2)
    c1, c2 = continuation(p1, 40, vocab), continuation(p2, 40, vocab)
    # Two EOS ids, each the first of them to appear in one prompt's continuation.
    eos_a = c1[5]
    eos_b = next(t for t in c2[3:] if t not in c1[:6] and t != eos_a)
    engine = fake_engine(eos=(eos_a, eos_b))
    sampled = SamplingParams(max_tokens=40, temperature=0.0)
    ended_by = {t: c.index(t) for c in (c1, c2) for t in (eos_a, eos_b) if t in c}
    stop_id = c1[2]
    handles = [
        engine.submit(p1, sampled),
        engine.submit(p2, sampled),
        engine.submit(p1, greedy(40)),  # ignore_eos
        engine.submit(p1, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_id])),
    ]
    results = run(engine, *handles)
    first_eos_1 = min(i for i, t in enumerate(c1) if t in (eos_a, eos_b))
    first_eos_2 = min(i for i, t in enumerate(c2) if t in (eos_a, eos_b))
    assert ended_by and results[0][:2] == (c1[: first_eos_1 + 1], "stop")
    assert results[1][:2] == (c2[: first_eos_2 + 1], "stop") and c2[first_eos_2] == eos_b
    assert results[2][:2] == (c1, "length")
    assert results[3][:2] == (c1[: c1.index(stop_id) + 1], "stop")
    # vLLM's stop_reason: None for EOS, the id for a stop token.
    assert [h.last_event.stop_reason for h in handles] == [None, None, None, stop_id]
    assert engine.stats().finished == {"stop": 3, "length": 1}


def test_the_log_shows_forced_decodes(caplog):
    engine = fake_engine(step_policies={"decode_interleave_every": 2})
    handles = [engine.submit(prompt(3, 1), greedy(10)), engine.submit(prompt(6 * CHUNK, 2), greedy(1))]
    with caplog.at_level(logging.INFO, logger="jaxserve.engine"):
        run(engine, *handles)
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("Prefill batch") for line in lines) == engine.stats().steps.prefill
    assert any(line.startswith("Decode batch (interleaved after 2 prefill steps)") for line in lines)


@pytest.mark.parametrize(
    "async_scheduling, pattern",
    [
        (False, "PD" * 8 + "P"),
        # With a step in flight the victim's first token arrives one decision late: one more chunk goes first.
        (True, "PP" + "DP" * 7),
    ],
)
def test_a_stall_budget_tighter_than_any_step_alternates_without_starving_prefill(async_scheduling, pattern):
    # 1 ns: every prefill step breaks it
    engine = fake_engine(step_policies={"max_decode_stall_ms": 1e-6}, async_scheduling=async_scheduling)
    victim = engine.submit(prompt(5, 1), greedy(40), request_id="victim")
    attacker = engine.submit(prompt(11 + 8 * CHUNK, 2), greedy(2), request_id="attacker")
    _, (attacker_tokens, _, _) = run(engine, victim, attacker)
    steps = burst(engine, "attacker")
    assert steps == pattern  # a decode after every chunk, and the prompt still completes
    assert len(attacker_tokens) == 2
    assert engine.stats().steps.forced["stall"] == sum(r.forced_by == "stall" for r in engine.step_record) >= 8


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
    engine = Engine(dataclasses.replace(MIXED, async_scheduling=False), CFG, mixed_runner, EOS).start()
    try:
        alone = {name: engine.submit(ids, greedy(n)).wait(timeout=60)[0] for name, (ids, n) in specs.items()}
    finally:
        engine.shutdown()
    assert StepKind.MIXED not in {r.kind for r in engine.step_record}  # alone, nobody rides along

    engine = Engine(MIXED, CFG, mixed_runner, EOS)
    handles = {name: engine.submit(ids, greedy(n), request_id=name) for name, (ids, n) in specs.items()}
    engine.start()
    try:
        together = {name: handle.wait(timeout=60)[0] for name, handle in handles.items()}
    finally:
        engine.shutdown()
    assert together == alone  # the synchronous loop alone, the overlapped one together
    attacker_steps = [r for r in engine.step_record if "attacker" in r.request_ids and r.kind is not StepKind.DECODE]
    # The victim prefilled alone (one prompt per step). Its first token is still on the device (in its slot) when the
    # attacker's first chunk is scheduled, and already feeds the victim's decode row there: every attacker chunk
    # carries the victim's token, in the 16 tokens of a pure chunk less the mixed step's 2 decode rows (padded):
    # 14 prompt tokens per step, 7 x 14 + 2. The outputs above show the token read from the slot is the right one.
    assert [r.kind for r in attacker_steps] == [StepKind.MIXED] * 8
    assert all("victim" in r.request_ids for r in attacker_steps)
    assert [r.num_tokens for r in attacker_steps] == [15] * 7 + [3]
    assert engine.stats().steps.mixed == 8
    assert_nothing_leaked(engine)


def test_a_prefill_only_request_returns_its_prompt_logprobs_once_and_frees_everything():
    engine = fake_engine()
    ids = prompt(3 * CHUNK + 5, 1)  # four chunks: prompt logprobs gathered across chunk boundaries
    only = engine.submit(ids, greedy(0, prompt_logprobs=2))
    first = engine.submit(ids, greedy(1, logprobs=0, prompt_logprobs=1))
    plain = engine.submit(ids, greedy(3))
    (tokens, reason, _), (first_tokens, first_reason, _), (plain_tokens, _, _) = run(engine, only, first, plain)
    assert (tokens, reason, only.last_event.logprobs) == ([], "length", None)
    assert [lp.token_id for lp in only.last_event.prompt_logprobs] == ids[1:]
    assert first_reason == "length" and first.last_event.token_ids == tuple(first_tokens)
    assert [lp.token_id for lp in first.last_event.logprobs] == first_tokens
    assert [lp.token_id for lp in first.last_event.prompt_logprobs] == ids[1:]
    assert plain.last_event.prompt_logprobs is None and plain.last_event.logprobs is None
    assert plain_tokens == continuation(ids, 3, CFG.vocab_size)
    assert engine.stats().generation_tokens == 4  # the prefill-only request generated nothing
    assert_nothing_leaked(engine)


def test_logprobs_come_one_per_token_and_the_prompt_ones_only_on_the_first_event():
    engine = fake_engine()
    ids = prompt(2 * CHUNK + 3, 2)

    async def events():
        handle = engine.submit(ids, greedy(5, logprobs=1, prompt_logprobs=0))
        return [event async for event in handle.events()]

    engine.start()
    try:
        events = asyncio.run(asyncio.wait_for(events(), 60))
    finally:
        engine.shutdown()
    assert events[-1].finish_reason == "length"
    assert [e.prompt_logprobs is not None for e in events] == [True, False, False, False, False]
    assert [lp.top for lp in events[0].prompt_logprobs] == [()] * (len(ids) - 1)  # prompt_logprobs=0: no top list
    assert [e.logprobs[0].token_id for e in events] == [e.token_ids[0] for e in events]
    assert_nothing_leaked(engine)
