"""DSpark drafting (`--speculative-config '{"method": "dspark", ...}'`) on a tiny checkpoint written as DeepSeek-V4
0731 lays one out (46-style compress_ratios, the drafter's `mtp.{0,1,2}` stages and Markov head, FP8/FP4): through
HTTP, greedy tokens with drafting on equal those with it off, one request and eight at once, with chunked prompts,
mixed steps (prompt chunks beside verify rows) and prefix-cache hits; sampled tokens follow the same distribution; a
stop or max_tokens inside accepted drafts ends the request there; nothing is leaked after 500 random requests with
aborts and stops; the refusals.

The drafter's stages are random, so on their own they would never guess right. Its Markov head, of rank V, is set to
the target's own greedy bigrams (read from the drafting-off run): each draft is then the token that followed the
previous one there, so some drafts are accepted and some rejected, and both paths run."""

from __future__ import annotations

import dataclasses
import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2_contingency
from test_release_0731 import BACKBONE, RATIOS
from test_server import serve_app, settled, wait_for

from jaxserve.checkpoints.load import load_model
from jaxserve.checkpoints.writer import write_checkpoint
from jaxserve.config import ConfigError, DSparkConfig, EngineConfig, SpeculativeConfig, load_config
from jaxserve.engine import Engine
from jaxserve.model.cache import abstract_cache, abstract_dspark_cache, kv_geometry
from jaxserve.model.sharding import make_mesh
from jaxserve.model.weights import abstract_weights, init_weights, is_info, nbytes, weights_nbytes
from jaxserve.request import SamplingParams
from jaxserve.request.step import StepKind
from jaxserve.runner import Buckets, ModelRunner
from jaxserve.runner.plan import state_bytes, weight_bytes
from jaxserve.server import create_app
from jaxserve.server.config import ServerConfig

K = 4  # drafts a step
DSPARK = DSparkConfig(block_size=5, noise_token_id=3, target_layer_ids=(2, 3, 4), markov_rank=BACKBONE.vocab_size)
RELEASE = dataclasses.replace(BACKBONE, nextn_layers=1, dspark=DSPARK)
# Pages of 128 tokens (a page holds whole entries of the release's HCA rate, 128): a prompt past 128 tokens leaves a
# snapshot for the next request with its prefix.
CONFIG = EngineConfig(
    dtype="float32",
    kernels="reference",
    max_num_seqs=8,
    chunked_prefill_size=32,
    max_prefill_rows=1,
    page_size=128,
    max_model_len=256,
    max_queued_requests=600,
    decode_log_interval=1000,
)
BUCKETS = Buckets(prefill_rows=(1,), prefill_chunks=(32,), decode_rows=(1, 8))
# Drafting's: prompt chunks also ride in verify steps (mixed steps, a chunk of 32 - 8 beside 8 verify rows).
MIXED_BUCKETS = dataclasses.replace(BUCKETS, mixed=True)
RNG = np.random.default_rng(3)
PROMPTS = [[int(t) for t in RNG.integers(7, BACKBONE.vocab_size, n)] for n in (5, 40, 70, 9, 33, 100, 17, 61)]
LONG = PROMPTS[5] * 2  # 200 tokens: past a page, so its second run starts from the first one's snapshot
FRESH = PROMPTS[7] * 3  # 183 tokens, as LONG, served with drafting by one test only


def _write(weights, folder):
    """`weights` (the backbone and the drafter) as the 0731 release lays them out."""
    write_checkpoint(weights, RELEASE.with_drafter("dspark"), folder, quantize=True, dtype="float32")
    file = folder / "config.json"
    raw = json.loads(file.read_text())
    raw["compress_ratios"] = [RATIOS[kind] for kind in BACKBONE.layer_kinds] + [0] * DSPARK.stages
    del raw["layer_types"], raw["compress_rates"]
    file.write_text(json.dumps(raw, indent=2))
    return folder


def _served(folder, k: int | None):
    """A started engine and its HTTP app on the checkpoint in `folder`, drafting k tokens a step (None: none)."""
    spec = None if k is None else SpeculativeConfig("dspark", k)
    cfg = dataclasses.replace(CONFIG, model=str(folder), speculative_config=spec)
    model = load_model(folder, make_mesh(1, 1), "float32", skip_tokenizer=True, drafter=cfg.drafter)
    buckets = BUCKETS if k is None else MIXED_BUCKETS
    runner = ModelRunner(model.config, model.weights, kv_geometry(cfg, model.config), make_mesh(1, 1), buckets)
    runner.warmup()
    engine = Engine(cfg, model.config, runner, [model.config.eos_token_id]).start()
    return engine, create_app(engine, model.tokenizer, "dspark", ServerConfig(log_stats_interval=0))


def _greedy(url: str, prompts: list[list[int]], max_tokens: int = 20) -> list[list[int]]:
    """Each prompt's greedy completion token ids, all requests in flight at once."""

    def one(prompt: list[int]) -> list[int]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _runs(url: str, engine: Engine) -> dict:
    """One request alone, eight at once, and a long prompt twice (the second a prefix-cache hit)."""
    runs = {"single": _greedy(url, PROMPTS[:1]), "batch": _greedy(url, PROMPTS)}
    runs["long"] = [_greedy(url, [LONG])[0] for _ in range(2)]
    wait_for(lambda: settled(engine), 5, "the requests to finish")
    return runs


@dataclasses.dataclass
class Served:
    off: dict  # the drafting-off runs (_runs)
    plain: Engine  # drafting off
    drafting: Engine  # drafting on, K a step, the Markov head set to the bigrams of `off`
    url: str  # drafting's HTTP server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The greedy runs with drafting off, then a server drafting with the Markov head set to those runs' bigrams."""
    weights = init_weights(jax.random.key(5), RELEASE.with_drafter("dspark"), std=0.1)
    plain, app = _served(_write(weights, tmp_path_factory.mktemp("off")), None)
    try:
        with serve_app(app, plain) as server:
            off = _runs(server.url, plain)
            off["fresh"] = _greedy(server.url, [FRESH])
        bigrams = np.zeros(BACKBONE.vocab_size, np.int64)
        for prompt, tokens in zip(PROMPTS + [FRESH], off["batch"] + off["fresh"]):
            sequence = prompt + tokens
            bigrams[sequence[len(prompt) - 1 : -1]] = sequence[len(prompt) :]
        markov = np.zeros((BACKBONE.vocab_size, BACKBONE.vocab_size), np.float32)  # [r = V, V]: previous -> next
        markov[np.arange(BACKBONE.vocab_size), bigrams] = 50.0
        assert weights.dspark is not None
        drafter = dataclasses.replace(
            weights.dspark, markov_embed=jnp.eye(BACKBONE.vocab_size), markov_out=jnp.asarray(markov)
        )
        folder = _write(dataclasses.replace(weights, dspark=drafter), tmp_path_factory.mktemp("on"))
        drafting, app = _served(folder, K)
        try:
            with serve_app(app, drafting) as server:
                yield Served(off, plain, drafting, server.url)
        finally:
            drafting.shutdown()
    finally:
        plain.shutdown()


def test_greedy_tokens_are_the_same_with_dspark_drafts_through_http(served):
    mixed_before = served.drafting.stats().steps.by_kind[StepKind.MIXED]
    on = _runs(served.url, served.drafting)
    assert all(len(tokens) == 20 for tokens in served.off["batch"])
    assert on == {name: served.off[name] for name in on}
    # Eight requests at once: later prompts' chunks rode in verify steps of the running ones.
    assert served.drafting.stats().steps.by_kind[StepKind.MIXED] > mixed_before
    drafts = served.drafting.stats().drafts
    # Both paths ran: the drafts (the target's own bigrams) were often right and sometimes wrong.
    assert 0 < drafts.accepted_tokens < drafts.draft_tokens, drafts
    assert len(drafts.accepted_per_position) == K and drafts.draft_tokens <= K * drafts.drafts


def test_a_prefix_cache_hit_drafts_from_the_snapshot_of_the_drafter_state(served):
    engine = served.drafting
    runs = []
    for _ in range(2):
        before = engine.stats()
        tokens = _greedy(served.url, [FRESH])[0]
        wait_for(lambda: settled(engine), 5, "the request to finish")
        after = engine.stats()
        hit = after.prefix_cache.hits - before.prefix_cache.hits
        runs.append((tokens, hit, after.drafts.accepted_tokens - before.drafts.accepted_tokens))
    (first, first_hit, first_accepted), (second, second_hit, second_accepted) = runs
    assert second == first == served.off["fresh"][0]
    assert second_hit >= CONFIG.page_size > first_hit
    # The drafter's rings came back from the snapshot as the target's did: the same drafts, the same acceptances.
    assert second_accepted == first_accepted > 0


def test_sampled_tokens_follow_the_target_distribution(served):
    """The 2nd and 3rd tokens (the first ones a verify step makes) of 300 seeded samples each way: a chi-square
    test of the two frequency tables."""
    sampling = [SamplingParams(max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True) for seed in range(300)]
    counts = {
        name: [handle.wait(120)[0] for handle in [engine.submit(PROMPTS[1], s) for s in sampling]]
        for name, engine in (("off", served.plain), ("on", served.drafting))
    }
    assert counts["on"] != counts["off"]  # drafting draws other random numbers: not the same samples
    for position in (1, 2):
        tokens = sorted({out[position] for outs in counts.values() for out in outs})
        table = np.array([[sum(out[position] == t for out in outs) for t in tokens] for outs in counts.values()])
        common = table.sum(axis=0) >= 10  # rare tokens pooled, so every expected count is large enough
        pooled = np.concatenate([table[:, common], table[:, ~common].sum(axis=1, keepdims=True)], axis=1)
        pooled = pooled[:, pooled.sum(axis=0) > 0]
        assert chi2_contingency(pooled).pvalue > 0.01, (position, pooled)
    wait_for(lambda: settled(served.drafting), 5, "the requests to finish")


def test_a_stop_inside_a_block_of_accepted_drafts_ends_the_request_there(served):
    engine = served.drafting
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = served.off["batch"][2]
    before = engine.stats().drafts.accepted_tokens
    for j in sorted({full.index(t) for t in full})[1:8]:  # each token, as a stop token at its first occurrence
        handle = engine.submit(PROMPTS[2], dataclasses.replace(greedy, stop_token_ids=(full[j],)))
        tokens, reason, error = handle.wait(60)
        assert handle.last_event is not None
        assert (tokens, reason, error, handle.last_event.stop_reason) == (full[: j + 1], "stop", None, full[j]), j
    wait_for(lambda: settled(engine), 5, "the requests to finish")
    assert engine.stats().drafts.accepted_tokens > before


def test_a_verify_step_delivers_its_kept_tokens_as_one_event(served):
    """As vLLM streams a step's output: a verify step's accepted drafts and its sampled token come in one event (one
    chunk to an HTTP client), not one event a token."""
    engine = served.drafting
    before = engine.stats().drafts.accepted_tokens
    handle = engine.submit(PROMPTS[2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    events = list(handle.sync_events(60))
    wait_for(lambda: settled(engine), 5, "the request to finish")
    accepted = engine.stats().drafts.accepted_tokens - before
    assert [t for event in events for t in event.token_ids] == served.off["batch"][2]
    assert len(events[0].token_ids) == 1  # prefill's token
    # Every later event is one verify step's: its accepted drafts, then one sampled token.
    assert sum(len(event.token_ids) - 1 for event in events[1:]) == accepted > 0


def test_max_tokens_inside_a_block_of_accepted_drafts_ends_the_request_there(served):
    """Overlapped, the next verify step is dispatched before the host sees how many drafts the one before kept: when
    those reached max_tokens, the device keeps no token for it, and the request ends with exactly max_tokens."""
    engine = served.drafting
    full = served.off["batch"][2]
    extra_steps = 0
    for max_tokens in range(2, 13):
        accepted, steps_before = engine.stats().drafts.accepted_tokens, len(engine.step_record)
        handle = engine.submit(PROMPTS[2], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        assert handle.wait(60) == (full[:max_tokens], "length", None), max_tokens
        wait_for(lambda: settled(engine), 5, "the request to finish")
        decode_steps = [r for r in list(engine.step_record)[steps_before:] if r.kind is StepKind.DECODE]
        assert all(r.request_ids == (handle.request_id,) for r in decode_steps)
        # Each step that delivered gave its accepted drafts and one more token: the first token came from prefill.
        delivering = max_tokens - 1 - (engine.stats().drafts.accepted_tokens - accepted)
        extra_steps += len(decode_steps) - delivering
    assert extra_steps > 0  # some request's last verify step was followed by one dispatched past its end
    after = engine.stats()
    assert after.free_pages == after.total_pages


def test_no_page_or_slot_is_leaked_after_random_requests_with_aborts_and_stops(served):
    engine = served.drafting
    rng = random.Random(7)
    free_slots = engine.scheduler.prefill_manager.slots.num_free
    before = engine.stats()
    handles = []
    for i in range(500):
        # Half the prompts from the ones the Markov head knows, so runs of accepted drafts are common.
        known = PROMPTS[i % len(PROMPTS)][: rng.randint(1, 40)]
        prompt = known if i % 2 else [rng.randrange(7, BACKBONE.vocab_size) for _ in range(rng.randint(1, 60))]
        sampling = SamplingParams(
            max_tokens=rng.randint(1, 12),
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            ignore_eos=True,
            stop_token_ids=tuple(rng.sample(range(7, BACKBONE.vocab_size), 6)) if rng.random() < 0.3 else (),
        )
        handles.append(engine.submit(prompt, sampling))
        if rng.random() < 0.15:
            engine.abort(handles[rng.randrange(len(handles))].request_id)
    for handle in handles:
        assert handle.wait(300)[1] in ("length", "stop", "abort")
    wait_for(lambda: settled(engine), 5, "every request to finish")
    after = engine.stats()
    assert after.free_pages == after.total_pages
    assert engine.scheduler.prefill_manager.slots.num_free == free_slots
    finished = {reason: after.finished.get(reason, 0) - before.finished.get(reason, 0) for reason in after.finished}
    assert finished.get("abort", 0) > 0 and finished.get("stop", 0) > 0 and finished.get("length", 0) > 0
    assert after.drafts.accepted_tokens > before.drafts.accepted_tokens


def test_the_drafter_asked_for_must_be_the_one_the_checkpoint_ships(tmp_path):
    folder = _write(init_weights(jax.random.key(1), RELEASE.with_drafter("dspark"), std=0.1), tmp_path)
    with pytest.raises(ConfigError, match='ships a DSpark drafter.*not MTP blocks.*"method": "dspark"'):
        load_model(folder, make_mesh(1, 1), "float32", skip_tokenizer=True, drafter="mtp")
    with pytest.raises(ConfigError, match="method='dspark': the checkpoint ships no DSpark drafter"):
        dataclasses.replace(load_config(folder), dspark=None).with_drafter("dspark")


def test_the_plan_counts_the_drafter_weights_and_its_rings():
    mesh = make_mesh(1, 1, jax.devices()[:1])
    drafting, plain = RELEASE.with_drafter("dspark"), RELEASE
    drafter = abstract_weights(drafting).dspark
    assert drafter is not None
    assert weight_bytes(drafting, mesh)[2] - weight_bytes(plain, mesh)[2] == weights_nbytes(drafter)
    spec = dataclasses.replace(CONFIG, speculative_config=SpeculativeConfig("dspark", K))
    geometry = kv_geometry(spec, drafting)
    rings = abstract_dspark_cache(drafting, geometry)
    # The target's cache with drafting's state rows, the drafter's rings ([stages, state rows, W, k]) beside it, and
    # each slot's position (int32).
    assert rings.window.shape == (DSPARK.stages, geometry.state_rows, BACKBONE.sliding_window, BACKBONE.head_dim)
    target = [info for info in jax.tree.leaves(abstract_cache(drafting, geometry), is_leaf=is_info)]
    target_state = sum(nbytes(info) for info in target if "pages" not in info.axes)
    assert state_bytes(drafting, geometry, mesh) == target_state + weights_nbytes(rings) + 4 * geometry.num_slots
