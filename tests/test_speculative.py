"""MTP speculative decoding end to end on the embedded default (trained, with one MTP block): the same greedy tokens
with and without drafts through HTTP (k = 1, 2, 3; one request and eight at once; chunked prompts and decode
interleaving on), the same distribution of sampled tokens, stops inside a run of accepted drafts, nothing leaked
after hundreds of random requests with aborts and stops, the refusals, the metrics."""

from __future__ import annotations

import dataclasses
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from scipy.stats import chi2_contingency
from test_disaggregation_engine import LocalPrefill
from test_server import metric_samples, serving, settled, wait_for

from jaxserve.checkpoints.load import load_model
from jaxserve.config import ConfigError, EngineConfig, SpeculativeConfig, parse_speculative_config
from jaxserve.engine import Engine
from jaxserve.model.cache import kv_geometry
from jaxserve.model.sharding import make_mesh
from jaxserve.request import InvalidRequest, SamplingParams
from jaxserve.request.step import StepKind
from jaxserve.runner import Buckets, ModelRunner
from training.default_model import SAMPLE_PROMPTS as PROMPTS

# Prompts are chunked (32 tokens a step) and a decode step is taken after every two prefill steps.
CONFIG = EngineConfig(
    dtype="float32",
    max_num_seqs=8,
    chunked_prefill_size=32,
    max_prefill_rows=1,
    page_size=16,
    max_model_len=256,
    max_queued_requests=600,
    step_policies={"decode_interleave_every": 2},
    decode_log_interval=1000,
)


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, make_mesh(1, 1), dtype=CONFIG.dtype, drafter="mtp")


# k's whose prefill steps also carry the running requests' verify rows (mixed steps, beside the interleave policy).
MIXED_K = 2


def _config(k: int | None, **overrides) -> EngineConfig:
    spec = None if k is None else SpeculativeConfig("mtp", k)
    return dataclasses.replace(CONFIG, speculative_config=spec, mixed_batches=k == MIXED_K or None, **overrides)


def _knobs(k: int | None) -> dict:
    """_config(k)'s fields, for test_server's `serving` (which overrides its own config with them)."""
    cfg = _config(k)
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


# Fewer shapes than the flags imply (compile time): one chunk length, and decode steps of one row or of eight.
BUCKETS = Buckets(
    prefill_rows=(1,), prefill_chunks=(CONFIG.chunked_prefill_size,), decode_rows=(1, CONFIG.max_num_seqs)
)


@pytest.fixture(scope="module")
def runners(loaded):
    """A compiled runner per k (None: no drafts), all on the same weights."""
    built = {}
    for k in (None, 1, 2, 3):
        cfg = _config(k)
        # The engine's own rule for what a mixed step's verify rows take of its chunk (Buckets.for_config).
        engines = Buckets.for_config(cfg)
        buckets = dataclasses.replace(BUCKETS, mixed=engines.mixed, decode_row_tokens=engines.decode_row_tokens)
        runner = ModelRunner(loaded.config, loaded.weights, kv_geometry(cfg, loaded.config), make_mesh(1, 1), buckets)
        runner.warmup()
        built[k] = runner
    return built


def _completions(url: str, prompts: list[str], max_tokens: int = 24, **fields) -> list[list[int]]:
    """Each prompt's completion token ids, all requests in flight at once."""

    def one(prompt: str) -> list[int]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **fields}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_greedy_tokens_are_the_same_with_and_without_drafts_through_http(runners, loaded):
    outputs = {}
    for k, runner in runners.items():
        with serving(runner, loaded, **_knobs(k)) as served:
            single = _completions(served.url, PROMPTS[:1])
            batch = _completions(served.url, PROMPTS)
            wait_for(lambda: settled(served.engine), 5, "the requests to finish")
            stats = served.engine.stats()
        outputs[k] = (single, batch)
        if k is not None:  # the drafts did their job: most were accepted, some rejected (both paths ran)
            assert 0 < stats.drafts.accepted_tokens < stats.drafts.draft_tokens, stats.drafts
            assert stats.drafts.acceptance_rate > 0.3, stats.drafts
        # Mixed steps where asked: prompt chunks rode in verify steps of the running requests.
        assert (stats.steps.by_kind[StepKind.MIXED] > 0) == (k == MIXED_K), k
    assert all(len(tokens) == 24 for tokens in outputs[None][1])
    for k in (1, 2, 3):
        assert outputs[k] == outputs[None], f"k={k}"


def _engine(runner, loaded, k: int | None, **overrides) -> Engine:
    cfg = dataclasses.replace(_config(k), **overrides)
    return Engine(cfg, loaded.config, runner, loaded.tokenizer.eos_ids).start()


def test_sampled_tokens_follow_the_same_distribution_with_and_without_drafts(runners, loaded):
    """For one prompt, the 2nd and 3rd output tokens (the first ones a verify step makes) of 400 seeded samples each
    way: a chi-square test of the two frequency tables."""
    prompt = loaded.tokenizer.encode("def fibonacci(n):\n")
    counts = {}
    for k in (None, 2):
        engine = _engine(runners[k], loaded, k)
        try:
            handles = [
                engine.submit(prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True))
                for seed in range(400)
            ]
            counts[k] = [h.wait(120)[0] for h in handles]
        finally:
            engine.shutdown()
    for position in (1, 2):
        tokens = sorted({out[position] for outs in counts.values() for out in outs})
        table = np.array([[sum(out[position] == t for out in counts[k]) for t in tokens] for k in (None, 2)])
        common = table.sum(axis=0) >= 10  # rare tokens pooled, so every expected count is large enough
        pooled = np.concatenate([table[:, common], table[:, ~common].sum(axis=1, keepdims=True)], axis=1)
        pooled = pooled[:, pooled.sum(axis=0) > 0]
        assert chi2_contingency(pooled).pvalue > 0.01, (position, pooled)


def test_a_stop_inside_accepted_drafts_ends_the_request_there(runners, loaded):
    prompt = loaded.tokenizer.encode(PROMPTS[2])
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine = _engine(runners[3], loaded, 3)
    try:
        full = engine.submit(prompt, greedy).wait(60)[0]
        # Each token of the run, as a stop token at its first occurrence: the request ends with it, nothing after
        # (each run also hits the prefix cache's pages and snapshot of the first: drafts must never write those).
        for j in sorted({full.index(t) for t in full})[1:8]:
            stopped = dataclasses.replace(greedy, stop_token_ids=(full[j],))
            handle = engine.submit(prompt, stopped)
            tokens, reason, error = handle.wait(60)
            assert handle.last_event is not None
            assert (tokens, reason, error, handle.last_event.stop_reason) == (full[: j + 1], "stop", None, full[j]), j
        wait_for(lambda: settled(engine), 5, "the requests to finish")
        assert engine.stats().drafts.accepted_tokens > 0
    finally:
        engine.shutdown()


def test_a_stop_string_inside_accepted_drafts_ends_the_text_there_through_http(runners, loaded):
    texts = {}
    for k in (None, 3):
        with serving(runners[k], loaded, **_knobs(k)) as served:
            body = {"prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0}
            full = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
            stop = full[len(full) // 2 : len(full) // 2 + 3]  # a piece of the text's middle
            choice = httpx.post(f"{served.url}/v1/completions", json={**body, "stop": [stop]}, timeout=120).json()
            wait_for(lambda: settled(served.engine), 5, "the requests to finish")
        texts[k] = (full, stop, choice["choices"][0]["text"], choice["choices"][0]["finish_reason"])
    full, stop, text, reason = texts[3]
    assert texts[3] == texts[None]
    assert (text, reason) == (full[: full.index(stop)], "stop")


def test_no_page_or_slot_leaks_after_random_requests_with_aborts_and_stops(runners, loaded):
    rng = random.Random(11)
    vocab = loaded.config.vocab_size
    engine = _engine(runners[2], loaded, 2, enable_prefix_caching=False)
    free_slots = engine.scheduler.prefill_manager.slots.num_free
    try:
        handles = []
        for i in range(500):
            prompt = [rng.randrange(7, vocab) for _ in range(rng.randint(1, 60))]
            sampling = SamplingParams(
                max_tokens=rng.randint(1, 12),
                temperature=rng.choice([0.0, 0.8]),
                seed=i,
                stop_token_ids=tuple(rng.sample(range(7, vocab), 40)) if rng.random() < 0.3 else (),
            )
            handles.append(engine.submit(prompt, sampling))
            if rng.random() < 0.15:
                engine.abort(handles[rng.randrange(len(handles))].request_id)
        for handle in handles:
            tokens, reason, _ = handle.wait(300)
            assert reason in ("length", "stop", "abort"), reason
        wait_for(lambda: settled(engine), 5, "every request to finish")
        stats = engine.stats()
        assert stats.free_pages == stats.total_pages
        assert engine.scheduler.prefill_manager.slots.num_free == free_slots
        assert stats.drafts.accepted_tokens > 0 and stats.finished.get("abort", 0) > 0 and stats.finished.get("stop")
    finally:
        engine.shutdown()


def test_what_drafting_cannot_honour_is_refused_naming_the_field(runners, loaded):
    engine = Engine(_config(1), loaded.config, runners[1], loaded.tokenizer.eos_ids)
    for field, sampling in (
        ("logprobs", SamplingParams(logprobs=2)),
        ("presence_penalty", SamplingParams(presence_penalty=0.5)),
        ("min_tokens", SamplingParams(min_tokens=2, max_tokens=4)),
        ("allowed_token_ids", SamplingParams(allowed_token_ids=(5, 6))),
    ):
        with pytest.raises(InvalidRequest, match=f"^{field}: not supported with speculative decoding") as raised:
            engine.check_admission([5, 6], sampling)
        assert raised.value.param == field


def test_the_speculative_config_flag_is_checked():
    assert parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 2}') == SpeculativeConfig("mtp", 2)
    dspark = parse_speculative_config('{"method": "dspark", "num_speculative_tokens": 7}')
    assert dspark == SpeculativeConfig("dspark", 7)
    assert EngineConfig(speculative_config=dspark).drafter == "dspark" and EngineConfig().drafter is None
    for text, message in (
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method='eagle'"),
        ('{"method": "dspark", "num_speculative_tokens": 9}', "=9: must be an integer in 1..8 for method 'dspark'"),
        ('{"method": "mtp", "num_speculative_tokens": 4}', "num_speculative_tokens=4: must be an integer in 1..3"),
        ('{"method": "mtp"}', "num_speculative_tokens is missing"),
        ('{"method": "mtp", "num_speculative_tokens": 1, "model": "x"}', "unknown fields \\['model'\\]"),
        ("mtp", "not JSON"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_speculative_config(text)
    drafting = EngineConfig(speculative_config=SpeculativeConfig("mtp", 2))
    assert (drafting.draft_tokens, drafting.overlapped, drafting.mixed_steps) == (2, True, True)


def test_spec_decode_metrics(runners, loaded):
    with serving(runners[2], loaded, **_knobs(2)) as served:
        _completions(served.url, PROMPTS[:2], max_tokens=16)
        wait_for(lambda: settled(served.engine), 5, "the requests to finish")
        samples = metric_samples(httpx.get(f"{served.url}/metrics").text)
        drafts = served.engine.stats().drafts
    assert samples[("jaxserve:spec_decode_num_draft_tokens_total", ())] == drafts.draft_tokens > 0
    assert samples[("jaxserve:spec_decode_num_accepted_tokens_total", ())] == drafts.accepted_tokens > 0
    per_position = [
        samples[("jaxserve:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))] for p in (0, 1)
    ]
    assert sum(per_position) == drafts.accepted_tokens and per_position[0] >= per_position[1]


def test_a_disaggregated_decode_server_drafts_from_the_mtp_state_its_prefill_server_handed_over(runners, loaded):
    """Prefill on a prefill-role runner (its chunks run the MTP block too), decode with 3 drafts on another engine:
    the same tokens as without drafts and the very same drafts accepted as colocated, so the MTP ring, the last
    streams and the slot's position arrived whole (a garbled draft state would still give the model's tokens, but
    not these acceptances)."""
    k = 3
    prefill_runner = ModelRunner(
        loaded.config,
        loaded.weights,
        kv_geometry(_config(k), loaded.config),
        make_mesh(1, 1),
        dataclasses.replace(BUCKETS, role="prefill", decode_row_tokens=k + 1),
    )
    prefill_runner.warmup()
    prefill_runner.warm_transfers(export=True, install=False)
    runners[k].warm_transfers(export=False, install=True)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:3]]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def generate(engine: Engine, **remote) -> tuple[list[list[int]], object]:
        try:
            handles = [engine.submit(p, greedy, request_id=f"r{i}", **remote) for i, p in enumerate(prompts)]
            return [h.wait(120)[0] for h in handles], engine.stats().drafts
        finally:
            engine.shutdown()

    plain, _ = generate(_engine(runners[None], loaded, None))
    colocated, colocated_drafts = generate(_engine(runners[k], loaded, k))
    prefill = _engine(prefill_runner, loaded, k, disaggregation_mode="prefill")
    try:
        decode = _engine(runners[k], loaded, k, disaggregation_mode="decode")
        disaggregated, drafts = generate(decode, remote=LocalPrefill(prefill))
    finally:
        prefill.shutdown()
    assert disaggregated == colocated == plain
    assert drafts == colocated_drafts and drafts.accepted_tokens > 0, (drafts, colocated_drafts)
