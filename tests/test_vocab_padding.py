"""Any vocabulary on any tensor-parallel size: a vocabulary the split does not divide is padded with zero rows at load
time (safetensors and orbax), served with the tokens and logprobs it has on one device, reported at start-up and
counted by the memory plan; no padded id is ever sampled or shown, whatever pushes it."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil

import jax
import numpy as np
import pytest

from jaxserve.checkpoints.load import load_model
from jaxserve.checkpoints.orbax_io import convert_checkpoint
from jaxserve.checkpoints.writer import write_checkpoint
from jaxserve.config import EngineConfig, load_config
from jaxserve.engine import Engine
from jaxserve.model.sharding import make_mesh
from jaxserve.model.weights import flatten_with_names, init_weights
from jaxserve.presets import preset
from jaxserve.request import InvalidRequest, Request, SamplingParams
from jaxserve.request.batch import StepBatch
from jaxserve.request.step import StepPlan, StepRow
from jaxserve.runner import build_runner
from jaxserve.runner.logprobs import prompt_logprobs
from jaxserve.runner.plan import make_plan, weight_bytes

CFG = preset("tiny", dtype="float32", vocab_size=211)  # prime: no tensor-parallel size above 1 divides it
TP = 2
PADDED = 212  # 211 rounded up to a multiple of TP (and of 4)
ENGINE = EngineConfig(
    dtype="float32",
    max_num_seqs=2,
    chunked_prefill_size=16,
    max_prefill_rows=1,
    page_size=8,
    max_model_len=64,
    mixed_batches=False,
    decode_log_interval=1000,
)
PROMPTS = [np.random.default_rng(4).integers(0, CFG.vocab_size, n).tolist() for n in (13, 21)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same random 211-token model as a safetensors folder and as its orbax conversion."""
    root = tmp_path_factory.mktemp("vocab211")
    src = write_checkpoint(init_weights(jax.random.key(7), CFG, std=0.15), CFG, root / "safetensors", dtype="float32")
    return {"safetensors": src, "orbax": convert_checkpoint(src, root / "orbax", dtype="float32")}


@pytest.fixture(scope="module")
def runners(checkpoints):
    """tensor-parallel size -> (the safetensors folder loaded on that many devices, its warmed-up runner)."""
    out = {}
    for tp in (1, TP, 2 * TP):
        mesh = make_mesh(tp, 1)
        loaded = load_model(checkpoints["safetensors"], mesh, dtype="float32")
        runner = build_runner(ENGINE, loaded.config, loaded.weights, mesh)
        runner.warmup()
        out[tp] = loaded, runner
    return out


@pytest.mark.parametrize("kind", ["safetensors", "orbax"])
def test_a_vocabulary_the_split_does_not_divide_loads_padded_with_zero_rows(checkpoints, kind):
    single = load_model(checkpoints["safetensors"], make_mesh(1, 1), dtype="float32")
    loaded = load_model(checkpoints[kind], make_mesh(TP, 1), dtype="float32")
    assert (loaded.config.vocab_size, loaded.config.padded_vocab_size) == (CFG.vocab_size, PADDED)
    assert single.config.padded_vocab_size == CFG.vocab_size  # one device: nothing to pad
    padded = []
    for (path, got), (_, want) in zip(flatten_with_names(loaded.weights), flatten_with_names(single.weights)):
        got, want = np.asarray(got), np.asarray(want)
        if got.shape == want.shape:
            np.testing.assert_array_equal(got, want, err_msg=path)
            continue
        (axis,) = [i for i, (a, b) in enumerate(zip(got.shape, want.shape)) if a != b]
        assert (want.shape[axis], got.shape[axis]) == (CFG.vocab_size, PADDED), path
        real, padding = np.split(got, [CFG.vocab_size], axis=axis)
        np.testing.assert_array_equal(real, want, err_msg=path)
        assert not padding.any(), f"{path}: its padding rows are not zeros"
        padded.append(path)
    hashed = [path for path, _ in flatten_with_names(single.weights) if path.endswith(".moe.tid2eid")]
    assert len(hashed) >= 1 and sorted(padded) == sorted(["embed", "head", *hashed])
    # The padded rows split evenly: each device holds half the embedding's rows and half the head's columns.
    assert {s.data.shape for s in loaded.weights.embed.addressable_shards} == {(PADDED // TP, CFG.hidden_size)}
    assert {s.data.shape for s in loaded.weights.head.addressable_shards} == {(CFG.hidden_size, PADDED // TP)}


async def _events(engine: Engine, prompt: list[int], sampling: SamplingParams):
    handle = engine.submit(prompt, sampling)
    return [event async for event in handle.events()]


def _serve(loaded, runner, samplings: list[SamplingParams]) -> list[list]:
    engine = Engine(ENGINE, loaded.config, runner, loaded.tokenizer.eos_ids).start()
    try:

        async def all_requests():
            return await asyncio.gather(*(_events(engine, p, s) for p, s in zip(PROMPTS, samplings)))

        return asyncio.run(all_requests())
    finally:
        engine.shutdown()


def _assert_logprobs_close(got, want, what: str) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.token_id == b.token_id, (what, i)
        assert abs(a.logprob - b.logprob) <= 1e-5, (what, i, a.logprob, b.logprob)
        top_a, top_b = dict(a.top), dict(b.top)
        assert set(top_a) == set(top_b) and all(t < CFG.vocab_size for t in top_a), (what, i, top_a, top_b)
        assert all(abs(top_a[t] - top_b[t]) <= 1e-5 for t in top_a), (what, i, top_a, top_b)


@pytest.mark.parametrize("tp", [TP, 2 * TP])
def test_split_over_two_or_four_devices_it_serves_the_tokens_and_logprobs_of_one(runners, tp):
    samplings = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5),
    ]
    single, split = (_serve(*runners[n], samplings) for n in (1, tp))
    for r, (want, got) in enumerate(zip(single, split)):
        tokens = [t for event in got for t in event.token_ids]
        assert tokens == [t for event in want for t in event.token_ids] and len(tokens) == 8, r
        assert got[-1].finish_reason == "length" and all(t < CFG.vocab_size for t in tokens), r
        # Within 1e-5 of one device's, which has no padding: a softmax that counted the padded id's logit (0) would
        # be some 1/212 off.
        logprobs = [entry for event in got for entry in event.logprobs]
        _assert_logprobs_close(logprobs, [entry for event in want for entry in event.logprobs], f"row {r}")
        _assert_logprobs_close(got[0].prompt_logprobs, want[0].prompt_logprobs, f"row {r} prompt")
        assert len(got[0].prompt_logprobs) == len(PROMPTS[r]) - 1


def _run_on(runner, samplings: list[SamplingParams], steps: int) -> list[list]:
    """Each prompt prefilled in one chunk and decoded `steps` times on the runner itself (no engine: it would refuse
    a logit_bias outside the vocabulary): [row][step] = RowOutput."""
    pages = runner.geometry.max_pages_per_seq
    requests = [
        Request(f"r{i}", prompt, sampling, slot=i, pages=list(range(1 + i * pages, 1 + (i + 1) * pages)))
        for i, (prompt, sampling) in enumerate(zip(PROMPTS, samplings))
    ]
    outputs: list[list] = [[] for _ in requests]
    for request in requests:
        for start in range(0, request.prompt_len, 16):
            row = StepRow.chunk(request, start, min(16, request.prompt_len - start))
            (out,) = runner.run(StepBatch.of(StepPlan(prefill=(row,)))).prefill
            request.num_sampled += row.samples_output
        request.output_ids.append(out.token_id)
        outputs[int(request.request_id[1:])].append(out)
    for _ in range(steps):
        result = runner.run(StepBatch.of(StepPlan.decode_of(requests)))
        for request, out in zip(requests, result.decode):
            request.output_ids.append(out.token_id)
            request.num_sampled += 1
            outputs[int(request.request_id[1:])].append(out)
    return outputs


def test_a_padded_id_is_never_sampled_or_shown_even_with_a_logit_bias_pushing_it(runners):
    loaded, runner = runners[TP]
    pushed = ((CFG.vocab_size, 100.0), (PADDED - 1, 100.0))  # the padded id, past the real vocabulary
    plain = [
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=20, ignore_eos=True),
    ]
    biased = [dataclasses.replace(s, logit_bias=pushed) for s in plain]
    with_bias, without = _run_on(runner, biased, 4), _run_on(runner, plain, 4)
    for row_with, row_without in zip(with_bias, without):
        assert [o.token_id for o in row_with] == [o.token_id for o in row_without]
        for out in row_with:
            assert out.token_id < CFG.vocab_size and all(t < CFG.vocab_size for t, _ in out.logprob.top)
    # Through the engine, such a bias is refused at admission against the real vocabulary, as on one device.
    engine = Engine(ENGINE, loaded.config, runner, loaded.tokenizer.eos_ids)
    with pytest.raises(InvalidRequest, match=r"logit_bias: token id 211 is outside the vocabulary \[0, 211\)"):
        engine.check_admission(PROMPTS[0], biased[0])


def test_the_memory_plan_counts_the_padded_vocabulary():
    mesh = make_mesh(TP, 1)
    as_held = dataclasses.replace(CFG, vocab_size=PADDED)  # what the devices hold, a vocabulary TP divides
    assert weight_bytes(CFG, mesh) == weight_bytes(as_held, mesh)
    # The plan reads the same: too little memory for the weights, so it stops before compiling anything.
    plan = make_plan(CFG, ENGINE, mesh, device_memory=1000)
    assert not plan.fits and plan.weights_bytes_per_device == weight_bytes(as_held, mesh)[0]
    assert plan.weights_bytes_total > weight_bytes(CFG, make_mesh(1, 1))[2]  # the padding rows are counted


def test_the_start_up_log_reports_the_padding(checkpoints, capsys):
    from jaxserve.cli.main import _setup

    cache = jax.config.jax_compilation_cache_dir
    for tp, line in (
        (TP, "vocabulary: 211 tokens, padded to 212 rows (zeros, never sampled) to split over tensor_parallel_size=2"),
        (1, None),
    ):
        cfg = dataclasses.replace(
            ENGINE, model=str(checkpoints["safetensors"]), tensor_parallel_size=tp, compilation_cache_dir=cache
        )
        engine, loaded = _setup(cfg)
        lines = [text for text in capsys.readouterr().out.splitlines() if text.startswith("vocabulary:")]
        assert lines == ([] if line is None else [line]), lines
        assert engine.model_config.vocab_size == CFG.vocab_size


def test_an_orbax_conversion_stored_with_other_vocabulary_rows_is_refused_not_padded(checkpoints, tmp_path):
    import orbax.checkpoint as ocp

    from jaxserve.checkpoints.orbax_io import restore_weights
    from jaxserve.checkpoints.safetensors_file import CheckpointError
    from jaxserve.model.sharding import for_mesh

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoints["orbax"], damaged)
    with ocp.StandardCheckpointer() as checkpointer:
        misc = checkpointer.restore(damaged / "misc")
        misc["embed"] = np.asarray(misc["embed"])[:-1]  # a row short: a padding restore would fill it silently
        shutil.rmtree(damaged / "misc")
        checkpointer.save(damaged / "misc", misc)
        checkpointer.wait_until_finished()
    mesh = make_mesh(TP, 1)
    with pytest.raises(CheckpointError, match=r"misc: embed is stored as \[210, 64\], the config needs \[211, 64\]"):
        restore_weights(damaged, for_mesh(CFG, mesh), mesh)


@pytest.mark.parametrize("asked", [True, False])
def test_prompt_logprobs_of_a_padded_head_are_those_of_the_real_columns(asked):
    # 12 real ids, fewer than MAX_LOGPROBS, and 4 padding columns whose logits would win every position.
    rng = np.random.default_rng(2)
    hidden = np.abs(rng.normal(size=(2, 5, 8))).astype(np.float32)  # positive: positive columns win
    real = rng.normal(size=(8, 12)).astype(np.float32)
    padded = np.concatenate([real, np.full((8, 4), 10, np.float32)], 1)
    assert ((hidden @ padded).argmax(-1) >= 12).all()
    targets = rng.integers(0, 12, (2, 5)).astype(np.int32)
    run = jax.jit(prompt_logprobs, static_argnames="vocab_size")
    want = run(hidden, real, targets, np.array([asked, False]), vocab_size=12)
    got = run(hidden, padded, targets, np.array([asked, False]), vocab_size=12)
    for name in ("token", "top_ids", "top"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), atol=1e-6, err_msg=name)
    assert got.top_ids.shape == (2, 5, 12) and (got.top_ids < 12).all()


def test_padded_weights_write_the_checkpoint_they_came_from(checkpoints, tmp_path):
    loaded = load_model(checkpoints["safetensors"], make_mesh(TP, 1), dtype="float32")
    again = write_checkpoint(loaded.weights, loaded.config, tmp_path / "again", dtype="float32")
    assert load_config(again).vocab_size == CFG.vocab_size
    original, written = (
        load_model(path, make_mesh(1, 1), dtype="float32") for path in (checkpoints["safetensors"], again)
    )
    for (path, got), (_, want) in zip(flatten_with_names(written.weights), flatten_with_names(original.weights)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)
