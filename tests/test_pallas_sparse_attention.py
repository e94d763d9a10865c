"""kernels.pallas.sparse_attention: the Pallas sink attention (interpret=True on CPU) equals the pure-JAX reference
kernels.attention.sink_attention -- decode and short chunks, with and without selected keys, key counts that are not
multiples of the block, masked keys and invalid picks, fully masked queries, dominant and negligible sinks, float32
and bfloat16, DeepSeek-V4's query norm and rotation (and the output's inverse) folded in, sinks read from a stack of
layers -- and lowers to a Triton call for GPUs (lowering only: no GPU here to compile or run it; compiled for an
H200 with the model: tests/test_plan_target.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.attention import QueryRotation
from jaxserve.kernels.attention import sink_attention as reference
from jaxserve.kernels.pallas.sparse_attention import sink_attention
from jaxserve.kernels.quant import LayerOf

BATCH, HEADS = 2, 4
SHARED, SELECTED = 37, 21  # 3 and 2 key blocks of 16, each with a partial last block
BLOCK = 16  # the smallest block the Triton lowering allows; small so the keys span several blocks

# float32: kernel and reference differ only in summation order and the online rescaling, ~1e-7 relative.
F32_TOL = dict(rtol=1e-5, atol=1e-5)
# bfloat16: both compute the same float32 values (to ~1e-7) and then round to bfloat16, where a value near a rounding
# boundary can land one bfloat16 ulp apart: 2^-7 relative at most, covered by rtol; atol for values near zero.
BF16_TOL = dict(rtol=2**-7, atol=2**-7)


def _inputs(seed, *, t, dims=32, heads=HEADS, selected=True, dtype=jnp.float32, keep=0.6):
    """Random q, keys and masks (about `keep` of the keys unmasked) and sinks of the logits' size (~N(0, 1))."""
    rng = np.random.default_rng(seed)
    args = dict(
        q=jnp.asarray(rng.normal(size=(BATCH, t, heads, dims)), dtype),
        shared=jnp.asarray(rng.normal(size=(BATCH, SHARED, dims)), dtype),
        shared_mask=jnp.asarray(rng.random((BATCH, t, SHARED)) < keep),
        sinks=jnp.asarray(rng.normal(size=heads), jnp.float32),
    )
    if selected:
        args["selected"] = jnp.asarray(rng.normal(size=(BATCH, t, SELECTED, dims)), dtype)
        args["selected_mask"] = jnp.asarray(rng.random((BATCH, t, SELECTED)) < keep)
    return args


def _pallas(args, **blocks):
    return sink_attention(**args, interpret=True, block_s=BLOCK, block_j=BLOCK, **blocks)


def _assert_matches_reference(args, tol=F32_TOL, **blocks):
    got = _pallas(args, **blocks)
    assert got.shape == args["q"].shape and got.dtype == args["q"].dtype
    expected = reference(**args)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), **tol)
    return np.asarray(got, np.float32)


@pytest.mark.parametrize("selected", [False, True], ids=["shared-only", "with-selected"])
@pytest.mark.parametrize("t", [1, 3], ids=["decode", "chunk"])
def test_matches_reference_float32(t, selected):
    _assert_matches_reference(_inputs(0, t=t, selected=selected))


@pytest.mark.parametrize("t,selected", [(1, True), (3, False)], ids=["decode-with-selected", "chunk-shared-only"])
def test_matches_reference_bfloat16(t, selected):
    _assert_matches_reference(_inputs(1, t=t, dims=64, selected=selected, dtype=jnp.bfloat16), tol=BF16_TOL)


@pytest.mark.parametrize(
    "t,selected,dtype,tol",
    [(1, True, jnp.float32, F32_TOL), (3, False, jnp.float32, F32_TOL), (1, True, jnp.bfloat16, BF16_TOL)],
    ids=["decode-with-selected", "chunk-shared-only", "decode-bfloat16"],
)
def test_the_query_rotation_and_a_layer_of_stacked_sinks(t, selected, dtype, tol):
    """With a QueryRotation (queries normalised per head and rotated to their positions, the output rotated back; the
    last 16 of 64 dims rotate) and the sinks a LayerOf of three layers' (the middle one used), the kernel equals the
    reference; the positions matter (a rotation at other positions gives another answer)."""
    rng = np.random.default_rng(8)
    args = _inputs(8, t=t, dims=64, selected=selected, dtype=dtype)
    args["q"] = args["q"] * 5.0  # the per-head norm is no identity
    freqs = tuple(float(f) for f in 1.0 / 10000 ** (np.arange(0, 16, 2) / 16))
    args["rotation"] = QueryRotation(jnp.asarray(rng.integers(0, 5000, (BATCH, t)), jnp.int32), freqs, 1e-6)
    stack = jnp.stack([args["sinks"] + 3.0, args["sinks"], args["sinks"] - 3.0])
    got = _assert_matches_reference(dict(args, sinks=LayerOf(stack, jnp.int32(1))), tol)
    np.testing.assert_allclose(got, np.asarray(reference(**args), np.float32), **tol)
    moved = QueryRotation(args["rotation"].positions + 7, freqs, 1e-6)
    assert np.abs(np.asarray(_pallas(dict(args, rotation=moved)), np.float32) - got).max() > 1e-2


def test_heads_not_a_multiple_of_the_head_block():
    """20 heads in blocks of 16: the second program's block overhangs the heads."""
    _assert_matches_reference(_inputs(2, t=3, heads=20), block_h=16)


def test_fully_masked_queries_put_all_weight_on_the_sink():
    """With no unmasked key the sink takes all the weight and the output is exactly 0, as in the reference."""
    args = _inputs(3, t=3)
    shared_mask = np.asarray(args["shared_mask"]).copy()
    selected_mask = np.asarray(args["selected_mask"]).copy()
    shared_mask[0, :2] = False  # row 0, queries 0 and 1: no shared key
    selected_mask[0, 0] = False  # query 0: no selected key either; query 1 keeps some
    shared_mask[1], selected_mask[1] = False, False  # row 1: nothing at all
    args.update(shared_mask=jnp.asarray(shared_mask), selected_mask=jnp.asarray(selected_mask))
    got = _assert_matches_reference(args)
    assert not got[0, 0].any() and not got[1].any()
    assert np.abs(got[0, 1]).min() > 0  # only selected keys: a real answer, not the empty one


def test_masked_keys_and_invalid_picks_contribute_nothing():
    """Masked shared keys and invalid picks made huge and aligned with the row's queries (logits ~1e2 against ~1 for
    the rest): leaking any of them into the running max or the sums would swamp the answer."""
    args = _inputs(4, t=3)
    # One shared mask for all the row's queries, so that a key masked for one query is masked for all.
    shared_mask = jnp.broadcast_to(args["shared_mask"][:, :1], args["shared_mask"].shape)
    aligned = 30 * np.asarray(args["q"]).sum(axis=(1, 2))  # [b, k]
    masked_shared = ~np.asarray(shared_mask[:, 0])[..., None]
    invalid_picks = ~np.asarray(args["selected_mask"])[..., None]
    args.update(
        shared=jnp.asarray(np.where(masked_shared, aligned[:, None], args["shared"])),
        shared_mask=shared_mask,
        selected=jnp.asarray(np.where(invalid_picks, aligned[:, None, None], args["selected"])),
    )
    got = _assert_matches_reference(args)
    ordinary = dict(_inputs(4, t=3), shared_mask=shared_mask)  # the same unmasked keys, ordinary masked ones
    np.testing.assert_allclose(got, np.asarray(_pallas(ordinary)), **F32_TOL)


@pytest.mark.parametrize("sink", [40.0, -1e4], ids=["sink-dominates", "sink-negligible"])
def test_extreme_sinks(sink):
    args = _inputs(5, t=3)
    args["sinks"] = jnp.full((HEADS,), sink, jnp.float32)
    expected = np.asarray(reference(**args))
    got = np.asarray(_pallas(args))
    # Relative to the output's own size: with a dominant sink every output is ~exp(-40) ~ 1e-17.
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    if sink > 0:
        assert np.abs(got).max() < 1e-12
    else:  # the sink's weight exp(-1e4) is 0: plain softmax attention over the unmasked keys
        assert np.abs(got).max() > 0.1


def test_growing_logits_rescale_earlier_blocks():
    """Key norms grow along the keys, so later blocks keep raising the running max (up to ~20 in the last): the sums of
    earlier blocks must be rescaled to each new max."""
    args = _inputs(6, t=1)
    growth = np.linspace(0.5, 8.0, SHARED, dtype=np.float32)[None, :, None]
    args["shared"] = args["shared"] * growth
    args["selected"] = args["selected"] * 8.0
    _assert_matches_reference(args)


@pytest.mark.parametrize("blocks", [dict(block_s=24), dict(block_j=8), dict(block_h=12)], ids=["s24", "j8", "h12"])
def test_block_sizes_must_suit_triton(blocks):
    with pytest.raises(ValueError, match="power of two"):
        sink_attention(**_inputs(7, t=1), interpret=True, **blocks)


@pytest.mark.parametrize(
    "dtype,heads,shared,selected",
    [(jnp.bfloat16, 64, 200, 512), (jnp.float32, 20, SHARED, SELECTED)],
    ids=["deepseek-v4-flash-decode", "odd-sizes-float32"],
)
def test_lowers_to_a_triton_call(dtype, heads, shared, selected):
    """Lowering for CUDA runs the Pallas->Triton lowering (power-of-two operands, supported ops) without a GPU;
    Triton's own compilation and the kernel's speed stay unchecked here."""
    b, t, k = 2, 1, 512
    avals = [
        jax.ShapeDtypeStruct((b, t, heads, k), dtype),
        jax.ShapeDtypeStruct((b, shared, k), dtype),
        jax.ShapeDtypeStruct((b, t, shared), jnp.bool_),
        jax.ShapeDtypeStruct((heads,), jnp.float32),
        jax.ShapeDtypeStruct((b, t, selected, k), dtype),
        jax.ShapeDtypeStruct((b, t, selected), jnp.bool_),
    ]
    lowered = jax.jit(sink_attention).trace(*avals).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()
