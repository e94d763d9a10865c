"""DeepSeek-V4.1 (model_type deepseek_v41): a tiny checkpoint in the release's format (tests/v41_tiny.py: CSA2's
shared compressed KV with ratio-2 and ratio-1 sources and sharers, index sources with the two-level top-k, Engram at
two layers, FP8 32x32 projections, FP4 experts, FP8 Engram tables) served over HTTP gives transformers-main's
greedy tokens and prompt logprobs (tests/data/v41_tiny/reference.json, made by tests/v41_make_reference.py, which
names the commit it ran): at one device and at TP 2 x EP 2, chunked prefill, prefix-cache hits, the Engram tables on
the devices and in host memory."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from v41_tiny import write_tiny_v41

from jaxserve.checkpoints.load import load_model
from jaxserve.checkpoints.orbax_io import convert_checkpoint
from jaxserve.config import CSA2, SWA, ConfigError, EngineConfig, config_from_dict, load_config, to_hf_dict
from jaxserve.engine import Engine
from jaxserve.model.cache import CacheGeometry, abstract_cache
from jaxserve.model.segments import layer_segments
from jaxserve.model.sharding import make_mesh
from jaxserve.model.weights import flatten_with_names
from jaxserve.presets import preset
from jaxserve.runner import build_runner
from jaxserve.runner.plan import decode_read_bytes, parameter_counts, weight_bytes
from jaxserve.server import create_app
from jaxserve.server.config import ServerConfig
from jaxserve.server.serving import BackgroundServer, bind

REFERENCE = json.loads((Path(__file__).parent / "data" / "v41_tiny" / "reference.json").read_text())
TOLERANCE = 1e-4  # prompt logprobs, float32
GREEDY = 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_v41(tmp_path_factory.mktemp("v41_tiny"))


def test_the_release_config_parses_into_the_shared_kv_schedule_and_engram(folder):
    cfg = load_config(folder, dtype="float32")
    assert cfg.v41 and cfg.fp8_block == 32 and cfg.rms_norm_eps == 1e-20
    assert cfg.layer_kinds == (SWA, SWA) + (CSA2,) * 6
    kv = cfg.shared_kv
    assert kv is not None and kv.ratios == (0, 0, 2, 2, 1, 1, 1, 1)
    assert (kv.kv_sources, kv.index_sources, kv.candidate_source) == ((2, 4), (2, 4, 6), 4)
    assert [kv.source_of(i) for i in range(2, 8)] == [2, 2, 4, 4, 4, 4]
    assert [kv.index_source_of(i) for i in range(2, 8)] == [2, 2, 4, 4, 6, 6]
    assert cfg.engram is not None and cfg.engram.layer_ids == (1, 4) and cfg.engram.columns == 6
    # Only the KV sources keep compressed entries (each for its group); every layer keeps its window.
    geo = CacheGeometry(num_slots=2, num_pages=4, page_size=16, max_pages_per_seq=2)
    layers = [c for segment in abstract_cache(cfg, geo) for c in segment]
    kinds = [k for segment in layer_segments(cfg) for k in segment.pattern]
    assert [c.entries is not None for c in layers] == [k.kv_source for k in kinds]
    assert [c.state is not None for c in layers] == [k.kv_source and k.rate > 1 for k in kinds]


def test_the_written_config_is_the_releases_composite_form_and_reads_back_the_same(folder):
    for cfg in (load_config(folder), load_config(folder).dequantized(), preset("v41-flash")):
        written = to_hf_dict(cfg)
        assert written["model_type"] == "deepseek_v41" and written["text_config"]["model_type"] == "deepseek_v41_text"
        assert config_from_dict(written, dtype=cfg.dtype) == cfg
    assert to_hf_dict(load_config(folder))["quantization_config"]["weight_block_size"] == [32, 32]


def test_an_orbax_conversion_restores_exactly_with_the_tables_on_the_devices_or_in_host_memory(folder, tmp_path):
    converted = convert_checkpoint(folder, tmp_path / "orbax", dtype="float32")
    mesh = make_mesh(2, 2)
    for placement in ("device", "host"):
        restored = load_model(converted, mesh, dtype="float32", engram_placement=placement)
        original = load_model(folder, mesh, dtype="float32", engram_placement=placement)
        assert restored.config == original.config and restored.config.engram_on_host == (placement == "host")
        for (path, got), (_, want) in zip(
            flatten_with_names(restored.weights), flatten_with_names(original.weights), strict=True
        ):
            assert got.dtype == want.dtype and got.sharding == want.sharding, path
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)
        # The n-gram products are made from the conversion's tokenizer, as from the release's.
        assert np.asarray(restored.weights.ngram_products).any()


def _raw(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(kv_source_layer_ids=[3]), "kv_source_layer_ids"),  # layer 2 is compressed and has no source before it
        (dict(index_source_layer_ids=[4]), "index_source_layer_ids"),  # layers 2, 3 have no picks to attend to
        (dict(candidate_source_layer_id=5), "candidate_source_layer_id"),  # not an index source
        (dict(gate_temp=2.0), "gate_temp"),
        (dict(engram_max_ngram_size=9), "engram_max_ngram_size"),
    ],
)
def test_a_schedule_the_reference_refuses_is_refused_naming_its_field(folder, change, field):
    raw = _raw(folder)
    raw["text_config"] |= change
    with pytest.raises(ConfigError, match=field):
        config_from_dict(raw)


def test_what_is_not_built_for_v41_is_refused_loudly(folder):
    cfg = load_config(folder, dtype="float32")
    with pytest.raises(ConfigError, match="speculative decoding of DeepSeek-V4.1"):
        cfg.with_drafter("mtp")
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8'"):
        abstract_cache(
            cfg, CacheGeometry(num_slots=1, num_pages=2, page_size=16, max_pages_per_seq=2, kv_cache_dtype="fp8")
        )


def _serve(folder: Path, tp: int = 1, ep: int = 1, **knobs):
    cfg = EngineConfig(
        model=str(folder),
        dtype="float32",
        max_num_seqs=2,
        chunked_prefill_size=32,  # prompt 0 (100 tokens) and prompt 1 (41) are prefilled in chunks
        max_prefill_rows=1,
        mixed_batches=False,  # fewer step shapes to compile (mixed steps are V4's tests' and the runner's alike)
        page_size=16,
        max_model_len=160,
        prefix_cache_snapshots=16,  # the second round's prompts find theirs (each prompt writes one a page)
        tensor_parallel_size=tp,
        expert_parallel_size=ep,
        decode_log_interval=1000,
        **knobs,
    )
    mesh = make_mesh(tp, ep)
    model = load_model(folder, mesh, cfg.dtype, engram_placement=cfg.engram_placement)
    engine = Engine(cfg, model.config, build_runner(cfg, model.config, model.weights, mesh), model.tokenizer.eos_ids)
    engine.start()
    app = create_app(engine, model.tokenizer, "v41", ServerConfig(log_stats_interval=0))
    server = BackgroundServer(app, bind("127.0.0.1", 0))
    server.start()
    return engine, server


def _complete(http: httpx.Client, prompt: list[int], prompt_logprobs: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": GREEDY, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    # Asking for prompt logprobs prefills the whole prompt (they are computed there): no prefix-cache hit.
    response = http.post(
        "/v1/completions", json=body | {"logprobs": 0} | ({"prompt_logprobs": 0} if prompt_logprobs else {})
    )
    assert response.status_code == 200, response.text
    return response.json()


def _served(http: httpx.Client) -> list[dict]:
    """Each reference prompt served twice: with its prompt logprobs, then without them, its full pages found in the
    prefix cache."""
    return [_complete(http, prompt, first) for first in (True, False) for prompt in REFERENCE["prompts"]]


@contextlib.contextmanager
def _client(folder: Path, **serving):
    engine, server = _serve(folder, **serving)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.address[1]}", timeout=300) as http:
            yield http
    finally:
        server.stop()
        engine.shutdown()


def _alternatives(p: int) -> dict[int, list[float]]:
    """Position i of prompt p + its greedy tokens -> the logprobs of its token that the reference's alternatives give
    there (each one near rounding or top-k decision of HF's forward taken the other way)."""
    out: dict[int, list[float]] = {}
    for alternative in REFERENCE["alternatives"][p]:
        for i, logprob in zip(alternative["positions"], alternative["logprobs"]):
            out.setdefault(i, []).append(logprob)
    return out


def _accepted(served: float, reference: float, alternatives: list[float]) -> bool:
    """A served logprob passes within TOLERANCE of the reference's, or of one alternative's at its position. HF's
    forward rounds values to FP8 / FP4 and picks top-k sets; a value within float32 noise of a rounding midpoint (or
    two top-k scores within noise of each other) has two right answers, and which one an implementation gives depends
    on the order of its float32 arithmetic, not on its correctness. Crossing one moves later logprobs by 1e-5 to 1
    (through the indexer's picks), so the reference records, for each such decision of its forward, the logprobs the
    other answer gives (tests/v41_make_reference.py, "Alternatives")."""
    return any(abs(served - value) <= TOLERANCE for value in (reference, *alternatives))


def _check_against_reference(bodies: list[dict]) -> None:
    prompts = REFERENCE["prompts"]
    failed = []
    for k, body in enumerate(bodies):
        p = k % len(prompts)
        n = len(prompts[p])
        choice = body["choices"][0]
        assert choice["token_ids"] == REFERENCE["greedy"][p], (k, p)
        alternatives = _alternatives(p)
        # (position i in prompt + greedy tokens, served logprob of its token, the reference's)
        checked = list(zip(range(n, n + GREEDY), choice["logprobs"]["token_logprobs"], REFERENCE["greedy_logprobs"][p]))
        assert len(choice["logprobs"]["token_logprobs"]) == len(REFERENCE["greedy_logprobs"][p]) == GREEDY
        if k < len(prompts):
            entries = choice["prompt_logprobs"]
            assert entries[0] is None and len(entries) == n
            served = [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], prompts[p][1:])]
            checked = list(zip(range(1, n), served, REFERENCE["prompt_logprobs"][p][1:])) + checked
        for i, value, reference in checked:
            if not _accepted(value, reference, alternatives.get(i, [])):
                others = alternatives.get(i, [])
                nearest = (
                    f"the nearest of {len(others)} alternatives there by {min(abs(value - a) for a in others):.1e}"
                    if others
                    else "no alternative there"
                )
                failed.append(
                    f"request {k}, prompt {p}, position {i}: served {value:.6f}, reference {reference:.6f} "
                    f"(off by {abs(value - reference):.1e}; {nearest})"
                )
    assert not failed, f"{len(failed)} logprobs off by over {TOLERANCE}:\n" + "\n".join(failed)
    # The second round's prompts started from the prefix cache's pages (all their full pages but a last token's).
    cached = [body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in bodies]
    assert cached[: len(prompts)] == [0] * len(prompts)
    assert cached[len(prompts) :] == [(len(p) - 1) // 16 * 16 for p in prompts]


@pytest.fixture(scope="module")
def device_http(folder):
    with _client(folder, engram_placement="device") as http:
        yield http


@pytest.fixture(scope="module")
def on_device(device_http) -> list[dict]:
    return _served(device_http)


def test_served_over_http_it_gives_the_references_tokens_and_logprobs(on_device):
    _check_against_reference(on_device)


def test_tensor_and_expert_parallel_with_engram_tables_in_host_memory_serve_the_same_tokens(folder, on_device):
    # One engine for both (each compiles its step shapes): TP 2 x EP 2 splits the tables' rows over the tensor
    # axis, each device's share in the host's memory, gathered there.
    with _client(folder, tp=2, ep=2, engram_placement="host") as http:
        on_host = _served(http)
    _check_against_reference(on_host)
    assert [b["choices"][0]["token_ids"] for b in on_host] == [b["choices"][0]["token_ids"] for b in on_device]


def test_image_content_is_refused_naming_it(device_http):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    message = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}
    response = device_http.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 4})
    assert response.status_code == 400
    assert "image content ('image_url') is not supported" in response.text and "messages" in response.text


def test_v41_flash_preset_is_the_releases_geometry_and_its_engram_tables_live_where_placed():
    cfg = preset("v41-flash", dtype="bfloat16")
    # DeepSeek's figures for the release: a 552B backbone and about 196B of Engram tables.
    total, active = parameter_counts(cfg)
    tables = sum(cfg.engram.num_embeddings) * cfg.engram.head_dim
    assert tables == 196_613_849_600 and abs((total - tables) - 552e9) <= 0.005 * 552e9
    routed = 40 * 3 * 384 * 5120 * 2304
    assert total - active == tables + routed - routed * 6 // 384
    mesh = make_mesh(8, 1)
    on_devices, by_format, whole = weight_bytes(cfg, mesh)
    on_host, host_by_format, host_whole = weight_bytes(cfg.with_engram_placement("host"), mesh)
    # Each table: its rows padded to the 8-way split, 256 FP8 codes and 8 ue8m0 scale bytes a row, an eighth a device.
    rows = [-(-r // 8) * 8 for r in cfg.engram.num_embeddings]
    assert host_by_format["fp8_e4m3 in host memory"] == sum(rows) * 256 // 8
    assert host_by_format["scales in host memory"] == sum(rows) * 8 // 8
    assert on_devices - on_host == sum(rows) * (256 + 8) // 8 and whole == host_whole
    assert 500e9 <= whole <= 505e9  # about 510 GB as released (the vision tower and DSpark stages are not held)


def test_a_decode_steps_least_reads_count_every_indexer_key_and_the_picked_entries_of_each_kv_source(folder):
    cfg = load_config(folder, dtype="float32")
    mesh = make_mesh(1, 1)
    # Float32 store: an entry is head_dim x 4 B, an indexer key index_head_dim x 4 B. Per row at context 100: the
    # ratio-2 source's 50 keys and its 8 (index_topk) picked entries, the ratio-1 source's 100 keys and 8 entries.
    entry, key = 64 * 4, 32 * 4
    per_row = 50 * key + 8 * entry + 100 * key + 8 * entry
    assert decode_read_bytes(cfg, mesh, 2, 100) - decode_read_bytes(cfg, mesh, 2, 0) == 2 * per_row
