"""Batch-invariant serving (`--batch-invariant`): a request's tokens and logprobs are a function of the request alone.

Through HTTP on the embedded default checkpoint, in float32 and bfloat16: 20 seeded requests (greedy and sampled,
top-2 logprobs, some with prompt logprobs) are each served alone (8 of them again, from a prefix-cache hit), then in
groups among 1 to 63 random other requests (mixed steps on, chunks of up to 80 tokens, shortened by the decode rows a
mixed step carries), beside requests whose clients hang up mid-stream (aborted), and all at once on a server with
chunks of 16 and mixed steps off: every served copy is bitwise the one served alone.

Also: the tiles `kernels.tiles.rowwise` computes rows in give a row the same bits whatever the row count, the row's
place and its neighbours, and what batch invariance does not cover yet is refused by name.
"""

from __future__ import annotations

import contextlib
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.checkpoints.load import load_model
from jaxserve.config import ConfigError, EngineConfig
from jaxserve.engine import Engine
from jaxserve.kernels.tiles import ROW_TILE, rowwise
from jaxserve.model.cache import CacheGeometry
from jaxserve.model.sharding import make_mesh
from jaxserve.presets import preset
from jaxserve.request import Request, SamplingParams
from jaxserve.request.batch import StepBatch
from jaxserve.request.step import RowOutput, StepPlan, StepRow
from jaxserve.runner import build_runner
from jaxserve.runner.model_runner import Buckets, ModelRunner, step_kernels
from jaxserve.server import create_app
from jaxserve.server.config import ServerConfig
from jaxserve.server.serving import BackgroundServer, bind

TARGETS = 20
PREFIX_HITS = 8  # the targets served a second time alone, from the prefix cache
MAX_TOKENS = 8
# Mixed steps on: a mixed step carries every decode row (64) and 80 - 64 = 16 prompt tokens, a pure prefill step 80.
SERVING = dict(
    batch_invariant=True,
    max_num_seqs=64,
    max_model_len=256,
    page_size=16,
    chunked_prefill_size=80,
    max_prefill_rows=1,
    decode_log_interval=10**6,
)


def _targets(vocab: int) -> list[dict]:
    rng = random.Random(44)
    bodies = []
    for i in range(TARGETS):
        body = {
            "prompt": [rng.randrange(2, vocab) for _ in range(rng.randrange(33, 110))],
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "return_token_ids": True,
            "logprobs": 2,
            "seed": 1000 + i,
            "temperature": 0.0 if i % 2 == 0 else 0.8,
        }
        if i % 4 == 1:
            body["top_p"] = 0.9
        if i % 2 == 1:  # every prompt position's, so these never start from a prefix-cache hit
            body["prompt_logprobs"] = 1
        bodies.append(body)
    return bodies


def _others(rng: random.Random, n: int, vocab: int) -> list[dict]:
    return [
        {
            "prompt": [rng.randrange(2, vocab) for _ in range(rng.randrange(5, 64))],
            "max_tokens": rng.randrange(1, 12),
            "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.7]),
        }
        | rng.choice([{}, {"logprobs": 1}])
        for _ in range(n)
    ]


def _output(response: httpx.Response) -> tuple:
    """What must not depend on the batch: the tokens, their logprobs and top-2, the prompt logprobs."""
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    return choice["token_ids"], logprobs["token_logprobs"], logprobs["top_logprobs"], choice.get("prompt_logprobs")


@contextlib.contextmanager
def _server(loaded, runner, **knobs):
    """An HTTP server on `runner` (its buckets hold chunks of 16, 64 and 80 and the mixed step: an engine of other
    knobs takes what it needs of them)."""
    cfg = EngineConfig(dtype=loaded.config.dtype, **(SERVING | knobs))
    engine = Engine(cfg, loaded.config, runner, loaded.tokenizer.eos_ids).start()
    server = BackgroundServer(
        create_app(engine, loaded.tokenizer, "default", ServerConfig(log_stats_interval=0)), bind("127.0.0.1", 0)
    )
    server.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.address[1]}", timeout=600) as http:
            yield http, engine
    finally:
        server.stop()
        engine.shutdown()


def _serve_together(http: httpx.Client, bodies: list[dict], hang_up: int = 0) -> list[httpx.Response]:
    """Every body at once (each on its own connection), and `hang_up` streamed requests whose clients close after
    their second event (the server aborts them) while the rest run."""

    def hung_up(_) -> None:
        body = {"prompt": [5] * 60, "max_tokens": 190, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as s:
            assert s.status_code == 200
            events = 0
            for line in s.iter_lines():
                events += line.startswith("data:")
                if events == 2:
                    return

    with ThreadPoolExecutor(len(bodies) + hang_up) as pool:
        aborted = [pool.submit(hung_up, i) for i in range(hang_up)]
        served = list(pool.map(lambda body: http.post("/v1/completions", json=body), bodies))
        for future in aborted:
            future.result()
    return served


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_requests_tokens_and_logprobs_do_not_depend_on_its_batch(dtype):
    loaded = load_model(None, make_mesh(1, 1), dtype=dtype)
    vocab = loaded.config.vocab_size
    targets = _targets(vocab)
    rng = random.Random(7)
    mismatches: list[str] = []

    def check(case: str, indices: list[int], responses: list[httpx.Response]) -> None:
        for i, response in zip(indices, responses, strict=True):
            if _output(response) != alone[i]:
                mismatches.append(f"{dtype}, {case}: target {i}")

    runner = build_runner(EngineConfig(dtype=dtype, **SERVING), loaded.config, loaded.weights, make_mesh(1, 1))
    with _server(loaded, runner) as (http, engine):
        alone = []
        for i, body in enumerate(targets):
            first = http.post("/v1/completions", json=body)
            alone.append(_output(first))
            if i < PREFIX_HITS:  # again alone: its prompt's full pages and the state where they end are cached
                again = http.post("/v1/completions", json=body)
                cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (cached > 0) == ("prompt_logprobs" not in body), (i, cached)
                check("alone, from a prefix-cache hit", [i], [again])
        sampled = [i for i in range(TARGETS) if targets[i]["temperature"] > 0]
        assert len({alone[i][0][0] for i in sampled}) > 1  # the sampled ones drew different tokens

        # Among others: four groups of five, beside 1, some, many and 63 others, in random order.
        order = rng.sample(range(TARGETS), TARGETS)
        counts = [1, rng.randrange(2, 32), rng.randrange(32, 63), 63]
        for group, n in zip((order[g : g + 5] for g in range(0, TARGETS, 5)), counts):
            others = _others(rng, n, vocab)
            bodies = others + [targets[i] for i in group]
            places = rng.sample(range(len(bodies)), len(bodies))
            responses = _serve_together(http, [bodies[p] for p in places])
            in_place = {p: r for p, r in zip(places, responses)}
            check(f"among {n} others", group, [in_place[n + k] for k in range(len(group))])

        # Beside requests aborted mid-stream (and after them).
        aborted = engine.stats().finished.get("abort", 0)
        group = order[:8]
        responses = _serve_together(http, [targets[i] for i in group] + _others(rng, 6, vocab), hang_up=3)
        check("beside 3 aborted requests", group, responses[: len(group)])
        deadline = time.monotonic() + 5
        while engine.stats().finished.get("abort", 0) < aborted + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats().finished.get("abort", 0) == aborted + 3

    # Chunks of 16, no mixed steps: every target at once with 12 others.
    with _server(loaded, runner, chunked_prefill_size=16, mixed_batches=False) as (http, _):
        responses = _serve_together(http, [targets[i] for i in order] + _others(rng, 12, vocab))
        check("chunks of 16, mixed steps off, all at once", order, responses[:TARGETS])
    assert not mismatches, mismatches


def test_a_rows_tile_gives_it_the_same_bits_whatever_its_neighbours():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((128, 96)), jnp.float32)

    def fn(x, scale):  # a matmul, a transcendental, a softmax over an odd width, an RMS norm
        y = jax.nn.silu(x @ w) * scale[..., None]
        return jax.nn.softmax(y[:, :33], axis=-1), y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True))

    row, row_scale = rng.standard_normal(128), 1.5
    got: dict[int, set] = {1: set(), 2: set()}  # by leading axes (a tile's shape differs: so may its bits)
    for n in (1, 2, 5, ROW_TILE, ROW_TILE + 1, 3 * ROW_TILE + 7, 300):
        x = rng.standard_normal((n, 128))
        scale = rng.standard_normal(n)
        place = int(rng.integers(0, n))
        x[place], scale[place] = row, row_scale
        tiled = jax.jit(lambda x, s: rowwise(fn, (x, s), 1, ROW_TILE))(jnp.asarray(x, jnp.float32), jnp.asarray(scale))
        got[1].add(tuple(np.asarray(part)[place].tobytes() for part in tiled))
        # Two leading axes: rows of rows.
        two = jax.jit(lambda x, s: rowwise(fn, (x, s), 2, ROW_TILE))(
            jnp.asarray(x, jnp.float32)[None], jnp.asarray(scale)[None]
        )
        got[2].add(tuple(np.asarray(part)[0, place].tobytes() for part in two))
    assert len(got[1]) == len(got[2]) == 1


def test_batch_invariant_decode_buckets_start_at_a_tile_and_what_it_does_not_cover_is_refused():
    assert Buckets.for_config(EngineConfig(max_num_seqs=64, batch_invariant=True)).decode_rows == (16, 32, 64)
    assert Buckets.for_config(EngineConfig(max_num_seqs=10, batch_invariant=True)).decode_rows == (10,)
    assert Buckets.for_config(EngineConfig(max_num_seqs=64)).decode_rows[0] == 1
    with pytest.raises(ConfigError, match="batch_invariant: speculative decoding"):
        EngineConfig(batch_invariant=True, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ConfigError, match="batch_invariant: DeepSeek-V4.1"):
        step_kernels(preset("v41-flash"), make_mesh(1, 1), "reference", batch_invariant=True)
    assert step_kernels(preset("tiny"), make_mesh(1, 1), "reference", batch_invariant=True).row_tile == ROW_TILE


def test_a_prompt_leaves_the_same_cache_in_one_chunk_as_in_chunks_of_16():
    """The most sensitive check (the compressor states keep float32 projections): each of six prompts prefilled alone
    in one step of up to 64 tokens, and in steps of 16, leaves bitwise the same window ring, compressed entries,
    indexer keys and compressor states, and samples the same first token with the same logprob. In bfloat16, where
    XLA:CPU once split a row's matmul differently in the 64-token step (the weights' conversion hoisted out of a tile's
    loop: `Kernels.compiler_options`)."""
    loaded = load_model(None, make_mesh(1, 1), dtype="bfloat16")
    cfg = loaded.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, cfg.vocab_size, int(rng.integers(33, 90))).tolist() for _ in range(6)]
    page, per_seq = 16, 8
    geometry = CacheGeometry(num_slots=12, num_pages=1 + 12 * per_seq, page_size=page, max_pages_per_seq=per_seq)
    buckets = Buckets(prefill_rows=(1,), prefill_chunks=(16, 64), decode_rows=(16,))
    runner = ModelRunner(cfg, loaded.weights, geometry, make_mesh(1, 1), buckets, "reference", batch_invariant=True)
    runner.warmup()

    def prefill(slot: int, prompt: list[int], chunk: int) -> RowOutput:
        pages = list(range(1 + slot * per_seq, 1 + (slot + 1) * per_seq))
        request = Request(f"s{slot}", prompt, SamplingParams(temperature=0.0, logprobs=1), slot=slot, pages=pages)
        for start in range(0, len(prompt), chunk):
            row = StepRow.chunk(request, start, min(chunk, len(prompt) - start))
            out = runner.run(StepBatch.of(StepPlan(prefill=(row,)))).prefill[0]
            request.num_sampled += row.samples_output
        return out

    for i, prompt in enumerate(prompts):
        one, sixteens = prefill(2 * i, prompt, 64), prefill(2 * i + 1, prompt, 16)
        assert (one.token_id, one.logprob) == (sixteens.token_id, sixteens.logprob), i
    for path, leaf in jax.tree_util.tree_flatten_with_path(runner.cache)[0]:
        values = np.asarray(leaf)
        name = jax.tree_util.keystr(path)
        if leaf.ndim >= 2 and leaf.shape[1] == geometry.num_pages:  # paged pools: each slot's pages
            one = np.stack([values[:, 1 + 2 * i * per_seq : 1 + (2 * i + 1) * per_seq] for i in range(6)])
            sixteens = np.stack([values[:, 1 + (2 * i + 1) * per_seq : 1 + (2 * i + 2) * per_seq] for i in range(6)])
        elif leaf.ndim >= 2 and leaf.shape[1] >= geometry.num_slots:  # per-slot rows
            one, sixteens = values[:, 0:12:2], values[:, 1:12:2]
        else:
            continue
        assert one.tobytes() == sixteens.tobytes(), name
