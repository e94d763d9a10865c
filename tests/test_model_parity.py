"""jaxserve's DeepSeek-V4 forward against transformers' (CPU, float32): full prefill, irregular chunkings, and
prefill followed by token-by-token decode, several rows per batch at different positions, four configs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from harness import chunk_schedule, prefill_then_decode, run_schedule
from reference import build_reference, reference_logits

import jaxserve.model.forward as forward_module
from jaxserve.checkpoints.deepseek import load_weights
from jaxserve.config import config_from_dict
from jaxserve.kernels.table import REFERENCE_KERNELS
from jaxserve.presets import preset_dict

TOL = 1e-4
_CSA, _HCA, _SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

SCHEDULE_A = dict(
    lengths=[41, 29, 36],
    buckets=(1, 16, 48),
    full=[41, 29, 36],
    chunkings=[
        [[5, 7, 1, 13, 1, 1, 3, 1, 1, 1, 1, 6], [3, 11, 2, 9, 4], [16, 16, 4]],
        [[9, 9, 9, 9, 5], [1, 1, 1, 2, 3, 5, 8, 8], [13, 2, 7, 14]],
    ],
    prefill=[19, 3, 30],
)

CASES = {
    # Config A: every feature, window 8 evicts, HCA ratio 8, top-3 of up to 10 CSA entries.
    "A": dict(raw=preset_dict("tiny"), **SCHEDULE_A),
    # Config B: the real HCA ratio 128 and window 128 over 300 tokens, top-8.
    "B": dict(
        raw=preset_dict("tiny", sliding_window=128, index_topk=8, compress_rates={_CSA: 4, _HCA: 128}),
        lengths=[300, 257, 180],
        buckets=(1, 128, 320),
        full=[300, 257, 180],
        chunkings=[
            [[100, 37, 1, 90, 1, 1, 70], [64, 64, 1, 127, 1], [120, 60]],
            [[128, 128, 44], [7, 100, 50, 100], list(range(1, 19)) + [9]],
        ],
        prefill=[200, 250, 170],
    ),
    # Config C: another layer pattern (HCA first, SWA in the middle), three hash layers, HCA ratio 16, window 12.
    "C": dict(
        raw=preset_dict(
            "tiny",
            num_hidden_layers=5,
            layer_types=[_HCA, _CSA, _SWA, _CSA, _HCA],
            num_hash_layers=3,
            sliding_window=12,
            index_topk=5,
            compress_rates={_CSA: 4, _HCA: 16},
        ),
        lengths=[70, 53, 66],
        buckets=(1, 32, 80),
        full=[70, 53, 66],
        chunkings=[
            [[17, 1, 30, 22], [31, 22], [2, 3, 5, 7, 11, 13, 17, 8]],
            [[32, 32, 6], [1] * 5 + [24, 24], [15, 16, 17, 18]],
        ],
        prefill=[33, 48, 5],
    ),
    # Config D: Flash's layer pattern (2 SWA, (CSA, HCA) x 3, CSA; 3 hash layers), so the forward scans repeated
    # layers: [SWA hash] x 2, [CSA hash], [HCA, CSA] x 3.
    "D": dict(
        raw=preset_dict(
            "tiny", num_hidden_layers=9, layer_types=[_SWA, _SWA] + [_CSA, _HCA] * 3 + [_CSA], num_hash_layers=3
        ),
        **SCHEDULE_A,
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    spec = CASES[request.param]
    cfg = config_from_dict(spec["raw"], dtype="float32")
    model = build_reference(spec["raw"])
    folder = tmp_path_factory.mktemp(f"ref_{request.param}")
    model.save_pretrained(folder)
    weights, _ = load_weights(folder, cfg)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in spec["lengths"]]
    expected = [reference_logits(model, p) for p in prompts]
    return dict(
        spec,
        name=request.param,
        cfg=cfg,
        weights=weights,
        prompts=prompts,
        expected=expected,
        model=model,
        folder=folder,
    )


def _max_error(got: list[np.ndarray], expected: list[np.ndarray]) -> float:
    return max(float(np.abs(g - e).max()) for g, e in zip(got, expected))


def test_full_prefill(case):
    got = run_schedule(case["weights"], case["cfg"], case["prompts"], [case["full"]], case["buckets"])
    assert _max_error(got, case["expected"]) < TOL


@pytest.mark.parametrize("which", [0, 1])
def test_irregular_chunked_prefill(case, which):
    steps = chunk_schedule(case["chunkings"][which])
    got = run_schedule(case["weights"], case["cfg"], case["prompts"], steps, case["buckets"])
    assert _max_error(got, case["expected"]) < TOL


def test_prefill_then_decode(case):
    steps = prefill_then_decode(case["prefill"], case["lengths"])
    got = run_schedule(case["weights"], case["cfg"], case["prompts"], steps, case["buckets"])
    assert _max_error(got, case["expected"]) < TOL


def test_the_layers_traced_in_line_as_on_a_gpu(case):
    """On a GPU the kernel table unrolls the layer scan (`Kernels.unrolled_layers`): config D's repeated layers traced
    in line give transformers' logits too, prefill then decode."""
    if case["name"] != "D":
        pytest.skip("only config D scans repeated layers")
    kernels = dataclasses.replace(REFERENCE_KERNELS, unrolled_layers=True)
    forward = jax.jit(
        functools.partial(forward_module.logits_all, kernels=kernels),
        static_argnames=("cfg",),
        donate_argnames=("cache",),
    )
    steps = prefill_then_decode(case["prefill"], case["lengths"])
    got = run_schedule(case["weights"], case["cfg"], case["prompts"], steps, case["buckets"], forward=forward)
    assert _max_error(got, case["expected"]) < TOL


def test_broken_mhc_mixing_is_caught(case, monkeypatch):
    """The same check fails when the mHC mixing matrix is transposed: the parity tests can fail."""
    if case["name"] != "A":
        pytest.skip("one sensitivity control is enough")
    original = forward_module.hc_post

    def transposed_mix(out, h, post, comb):
        return original(out, h, post, jax.numpy.swapaxes(comb, -1, -2))

    monkeypatch.setattr(forward_module, "hc_post", transposed_mix)
    jax.clear_caches()
    try:
        got = run_schedule(case["weights"], case["cfg"], case["prompts"], [case["full"]], case["buckets"])
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert _max_error(got, case["expected"]) > 100 * TOL


def test_bfloat16_stays_close(case):
    """bf16 weights and activations run, and stay near the float32 reference (the error is printed)."""
    if case["name"] != "A":
        pytest.skip("bf16 is checked on config A")
    cfg16 = case["cfg"].with_dtype("bfloat16")
    weights16, _ = load_weights(case["folder"], cfg16)
    got = run_schedule(weights16, cfg16, case["prompts"], [case["full"]], case["buckets"])
    diffs = np.concatenate([np.abs(g - e).max(-1) for g, e in zip(got, case["expected"])])
    agree = np.concatenate([g.argmax(-1) == e.argmax(-1) for g, e in zip(got, case["expected"])])
    scale = max(float(np.abs(e).max()) for e in case["expected"])
    print(
        f"bf16 vs f32 reference: max abs logit error per position: median {np.median(diffs):.3f}, "
        f"max {diffs.max():.3f} (logit scale {scale:.2f}); greedy agreement {agree.mean():.1%}"
    )
    assert all(np.isfinite(g).all() for g in got)
    # Rounding moves most positions a little; a few move more where a routing or top-k choice flips.
    assert np.median(diffs) < 0.05 * scale
    assert agree.mean() > 0.85
