"""kernels.pallas.block_scaled_matmul (CPU, interpret mode) against the pure-JAX reference kernels.quant.einsum:
every einsum shape the model gives an FP8 weight, 2-D and 3-D weights (3-D blocks cutting heads and widths), K and N
with a full and a partial 128-block, M of 1, 8 and odd; block scales that change along every blocked axis (a scale
applied along the wrong axis fails); every finite e4m3 code; the scale bytes' extremes; the ue8m0 decode bit for bit;
and every case the kernel does not take returning exactly the reference's result."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from jaxserve.kernels.norm import rms_norm
from jaxserve.kernels.pallas.block_scaled_matmul import _ue8m0_to_f32, einsum, fp8_matmul
from jaxserve.kernels.quant import FP4, FP8, LayerOf, Quantized, dequantize, quantize, scale_values, scales_shape
from jaxserve.kernels.quant import einsum as reference

ALL_BYTES = np.arange(256, dtype=np.uint8)
FINITE_CODES = ALL_BYTES[(ALL_BYTES & 0x7F) != 0x7F].view(jnp.float8_e4m3fn).astype(np.float32)  # 254 (NaNs out)
FP8_MAX = 448.0
STEPS = np.array([5, 3, 2])  # per-axis change of the block exponents (all prime to 13)


def _weight(rng, shape: tuple[int, ...], blocks: tuple[int, ...]) -> Quantized:
    """An FP8 weight whose codes are the finite e4m3 values shuffled (every one appears once the weight holds a few
    hundred elements) and whose block scales are powers of two 2^-6 .. 2^6 that change from block to block along
    every blocked axis, by a different step on each.
    Each block's first element is 448 (the largest code), so `quantize` picks exactly that block's power of two and
    the codes come back as they were drawn."""
    codes = rng.permutation(np.resize(FINITE_CODES, int(np.prod(shape)))).reshape(shape)
    codes[tuple(slice(None, None, b) for b in blocks)] = FP8_MAX
    # Block index i_a along axis a adds STEPS[a] * i_a (mod 13) to a random start: neighbours along any axis differ.
    index = np.indices(scales_shape(shape, blocks))
    exponents = (rng.integers(13) + np.tensordot(STEPS[: len(shape)], index, axes=1)) % 13 - 6
    factor = 2.0**exponents
    for axis, b in enumerate(blocks):
        factor = np.repeat(factor, b, axis=axis)[tuple(slice(None, n) for n in shape[: axis + 1])]
    w = jax.jit(quantize, static_argnums=(1, 2))(jnp.asarray(codes * factor, jnp.float32), FP8, blocks)  # one compile
    np.testing.assert_array_equal(np.asarray(w.codes, np.float32), codes)
    np.testing.assert_array_equal(np.asarray(w.scales), exponents + 127)
    return w


def _assert_close(spec: str, got: jax.Array, x: jax.Array, w: Quantized, **kwargs) -> None:
    """Equal to the reference up to float rounding. The decoded weights are equal (codes times powers of two are
    exact in bfloat16 and float32); both sum the same terms x * w in float32, in different orders (the kernel K tile
    by K tile): each sum is within about K * 2^-24 * sum|x * w| of the exact one. A bfloat16 result rounds each
    float32 sum once more, so the two may also differ by one bfloat16 ulp (<= 2^-7 of the value). A wrong scale moves
    a block's share by a factor of 2 or more, far outside both."""
    want = reference(spec, x, w, **kwargs)
    assert got.dtype == want.dtype and got.shape == want.shape
    rounding = 2.0**-7 if want.dtype == jnp.bfloat16 else 0.0
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = np.einsum(spec, np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(dequantize(w, jnp.float32))))
    tolerance = 2 * x.shape[-1] * 2.0**-24 * bound + rounding * np.abs(want)
    excess = np.abs(got - want) - tolerance
    assert np.all(excess <= 0), f"{np.sum(excess > 0)} of {excess.size} outside the tolerance, worst by {excess.max()}"


def _x(rng, shape: tuple[int, ...], dtype) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape), dtype)


# (spec, x's shape, w's shape, w's blocks, x's dtype): every spec the model runs on an FP8 weight. K and N are 150 or
# 200 (a full and a partial 128-block) unless a 3-D weight's blocks are the subject; M (x's leading sizes) 1, 8, odd.
CASES = [
    ("btd,dr->btr", (1, 1, 200), (200, 150), (128, 128), jnp.bfloat16),
    ("btd,dr->btr", (2, 4, 200), (200, 150), (128, 128), jnp.float32),
    ("btd,dr->btr", (3, 5, 200), (200, 150), (128, 128), jnp.bfloat16),
    # wq_b-like: 128-row blocks split as (hb heads, wb columns), hb < H and wb < W, both with partial last blocks.
    ("btr,rhk->bthk", (1, 1, 200), (200, 6, 40), (128, 4, 16), jnp.float32),
    ("btr,rhk->bthk", (2, 4, 200), (200, 6, 40), (128, 4, 16), jnp.bfloat16),
    ("btr,rhk->bthk", (1, 7, 200), (200, 2, 160), (128, 1, 128), jnp.bfloat16),  # head_dim 160: wb=128 < W
    ("btd,dk->btk", (1, 13, 150), (150, 200), (128, 128), jnp.bfloat16),
    ("btx,xd->btd", (2, 4, 150), (150, 200), (128, 128), jnp.float32),
    ("nd,df->nf", (1, 200), (200, 150), (128, 128), jnp.float32),
    ("nd,df->nf", (8, 96), (96, 40), (96, 40), jnp.bfloat16),  # K, N under 128: the blocks clipped to the sizes
    ("nf,fd->nd", (9, 150), (150, 200), (128, 128), jnp.bfloat16),
    ("btr,rhc->bthc", (1, 3, 200), (200, 4, 64), (128, 2, 64), jnp.float32),  # the indexer's wq_b: 2 heads a block
]


@pytest.mark.parametrize("spec, x_shape, w_shape, blocks, dtype", CASES)
def test_matches_reference(spec, x_shape, w_shape, blocks, dtype):
    rng = np.random.default_rng(len(CASES) * len(spec) + sum(x_shape))
    x, w = _x(rng, x_shape, dtype), _weight(rng, w_shape, blocks)
    _assert_close(spec, einsum(spec, x, w, interpret=True), x, w)


@pytest.mark.parametrize("spec, x_shape, w_shape, blocks, dtype", CASES[::2])
def test_a_layer_of_a_stack_is_read_in_place(spec, x_shape, w_shape, blocks, dtype):
    """A LayerOf (how a scanned layer's projections reach the kernel on one device) gives the sliced layer's result,
    through the reference too; where the grouped kernel takes the weight, its call reads the whole stack (the layer
    picked inside the kernel, no slice of it copied out first)."""
    rng = np.random.default_rng(sum(w_shape))
    layers = [_weight(rng, w_shape, blocks) for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x = _x(rng, x_shape, dtype)
    view = LayerOf(stack, jnp.int32(2))
    run = jax.jit(lambda x, w: einsum(spec, x, w, interpret=True))
    _assert_close(spec, run(x, view), x, layers[2])
    np.testing.assert_array_equal(np.asarray(reference(spec, x, view)), np.asarray(reference(spec, x, layers[2])))
    (call,) = _pallas_calls(jax.make_jaxpr(run)(x, view).jaxpr)
    (codes,) = [v.aval.shape for v in call.invars if v.aval.dtype == jnp.float8_e4m3fn]
    if call.params["name"] == "grouped_matmul":
        assert codes[0] == 3  # the stack itself
    else:  # fp8_matmul's weights (its blocks do not flatten to runs of columns): the layer, sliced
        assert len(codes) == 2  # [K, N] (padded to the tiles), one layer


def _pallas_calls(jaxpr) -> list:
    calls = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            calls.append(eqn)
        for sub in jaxprs_in_params(eqn.params):
            calls += _pallas_calls(sub)
    return calls


def test_under_jit_and_with_preferred_element_type():
    """Inside jit (as the model calls it), and a bfloat16 x with a float32 result asked for."""
    rng = np.random.default_rng(1)
    spec = "btr,rhk->bthk"
    x, w = _x(rng, (2, 3, 200), jnp.bfloat16), _weight(rng, (200, 6, 40), (128, 4, 16))
    run = jax.jit(lambda x, w: einsum(spec, x, w, interpret=True, preferred_element_type=jnp.float32))
    _assert_close(spec, run(x, w), x, w, preferred_element_type=jnp.float32)


def test_every_finite_code():
    rng = np.random.default_rng(2)
    x, w = _x(rng, (5, 200), jnp.float32), _weight(rng, (200, 150), (128, 128))
    finite_bytes = ALL_BYTES[(ALL_BYTES & 0x7F) != 0x7F]
    np.testing.assert_array_equal(np.unique(np.asarray(w.codes).view(np.uint8)), finite_bytes)
    _assert_close("nd,df->nf", einsum("nd,df->nf", x, w, interpret=True), x, w)


@pytest.mark.parametrize(
    "byte, x_scale",
    [(0, 2.0**110), (1, 2.0**110), (127, 1.0), (254, 2.0**-120)],
    ids=["byte0", "byte1", "byte127", "byte254"],
)
def test_scale_extremes(byte, x_scale):
    """Every block at scale byte 0 (2^-127), 1, 127 or 254 (2^127), x scaled to keep the products normal floats.
    Under 2^127 the codes are kept below 2 so the decoded weight stays finite. XLA on CPU flushes denormals, so the
    2^-127 of byte 0 reads as 0 in the reference and here alike; test_scale_decode checks its bits."""
    rng = np.random.default_rng(3)
    codes = FINITE_CODES[np.abs(FINITE_CODES) < 2] if byte == 254 else FINITE_CODES
    shape, blocks = (200, 150), (128, 128)
    w = Quantized(
        jnp.asarray(rng.choice(codes, size=shape), jnp.float8_e4m3fn),
        jnp.full(scales_shape(shape, blocks), byte, jnp.uint8),
        FP8,
        blocks,
    )
    x = jnp.asarray(rng.normal(size=(3, 200)) * x_scale, jnp.float32)
    got = einsum("nd,df->nf", x, w, interpret=True)
    assert np.isfinite(np.asarray(got)).all() and (byte == 0 or np.asarray(got).any())
    _assert_close("nd,df->nf", got, x, w)


def test_scale_decode():
    """The kernel's ue8m0 decode, bit for bit: the byte as a float32 exponent, 0 the denormal 2^-127, 255 NaN."""
    bits = np.asarray(_ue8m0_to_f32(jnp.asarray(ALL_BYTES))).view(np.uint32)
    expected = ALL_BYTES.astype(np.uint32) << 23
    expected[0], expected[255] = 1 << 22, 0x7FC00000
    np.testing.assert_array_equal(bits, expected)
    np.testing.assert_array_equal(bits, np.asarray(scale_values(jnp.asarray(ALL_BYTES))).view(np.uint32))


@pytest.mark.parametrize("tiles", [dict(tile_m=16, tile_n=16, tile_k=16), dict(tile_m=16, tile_n=32, tile_k=128)])
def test_tile_sizes(tiles):
    """Smaller and larger tiles than the defaults: 8 K tiles per scale block, or one, give the same result."""
    rng = np.random.default_rng(4)
    x, w = _x(rng, (20, 200), jnp.float32), _weight(rng, (200, 150), (128, 128))
    column_scales = jnp.repeat(w.scales, 128, axis=1)[:, :150]
    got = fp8_matmul(x, w.codes, column_scales, 128, interpret=True, **tiles)
    _assert_close("nd,df->nf", got, x, w)


def test_rejects_bad_arguments():
    rng = np.random.default_rng(5)
    x, w = _x(rng, (4, 200), jnp.float32), _weight(rng, (200, 150), (128, 128))
    column_scales = jnp.repeat(w.scales, 128, axis=1)[:, :150]
    with pytest.raises(ValueError, match="power of two"):
        fp8_matmul(x, w.codes, column_scales, 128, interpret=True, tile_n=24)
    with pytest.raises(ValueError, match="column_scales"):
        fp8_matmul(x, w.codes, w.scales, 128, interpret=True)
    with pytest.raises(ValueError, match="no power-of-two factor"):
        fp8_matmul(x, w.codes, jnp.zeros((25, 150), jnp.uint8), 8, interpret=True)


@functools.cache
def _fallback_operands() -> dict:
    rng = np.random.default_rng(6)
    fp8 = _weight(rng, (200, 150), (128, 128))
    return dict(
        x=_x(rng, (3, 200), jnp.bfloat16),
        x150=_x(rng, (3, 150), jnp.bfloat16),
        int_x=jnp.asarray(rng.integers(-3, 3, size=(3, 200)), jnp.int32),
        plain=jnp.asarray(rng.normal(size=(200, 150)), jnp.bfloat16),
        fp4=quantize(jnp.asarray(rng.normal(size=(200, 150)), jnp.float32), FP4, (32, 1)),
        fp8=fp8,
        # K blocks of 8: no power-of-two K tile of >= 16 rows stays within one scale block.
        fp8_k8=dataclasses.replace(fp8, blocks=(8, 128), scales=jnp.zeros((25, 2), jnp.uint8)),
    )


FALLBACKS = {  # name: (spec, x, w, einsum options), x and w named in _fallback_operands
    "plain weight": ("nd,df->nf", "x", "plain", {}),
    "fp4": ("nd,df->nf", "x", "fp4", {}),
    "fp4 float32 result": ("nd,df->nf", "x", "fp4", dict(preferred_element_type=jnp.float32)),
    "output reordered": ("nd,df->fn", "x", "fp8", {}),
    "w contracted on its last axis": ("nf,df->nd", "x150", "fp8", {}),
    "implicit output": ("nd,df", "x", "fp8", {}),
    "ellipsis": ("...d,df->...f", "x", "fp8", {}),
    "precision option": ("nd,df->nf", "x", "fp8", dict(precision=jax.lax.Precision.HIGHEST)),
    "integer x": ("nd,df->nf", "int_x", "fp8", {}),
    "K blocks of 8": ("nd,df->nf", "x", "fp8_k8", {}),
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_fallbacks_are_the_reference(name):
    spec, x_name, w_name, kwargs = FALLBACKS[name]
    x, w = _fallback_operands()[x_name], _fallback_operands()[w_name]
    got, want = einsum(spec, x, w, interpret=True, **kwargs), reference(spec, x, w, **kwargs)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_a_triton_call(x_dtype):
    """Lowered for CUDA (no GPU needed), the kernel passes Pallas' Triton lowering rules (the e4m3 code load, the
    in-kernel scale decode) and becomes one Triton call: Flash's wq_a shape, 8 decode rows."""
    x = jax.ShapeDtypeStruct((8, 4096), x_dtype)
    codes = jax.ShapeDtypeStruct((4096, 1024), jnp.float8_e4m3fn)
    scales = jax.ShapeDtypeStruct((32, 1024), jnp.uint8)
    lowered = fp8_matmul.trace(x, codes, scales, 128).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("case", [0, 1, 4, 11])
def test_an_input_norm_is_folded_into_the_grouped_kernel(case):
    """einsum(..., norm=) (the query's low-rank norm, which both projections reading it fold in) equals the reference's
    rms_norm and then the einsum, with the norm weight plain or a `LayerOf` of a stack; where the grouped kernel takes
    the weight it normalises x's rows as it loads them: no rsqrt runs outside the kernel."""
    spec, x_shape, w_shape, blocks, dtype = CASES[case]
    rng = np.random.default_rng(case)
    x, w = _x(rng, x_shape, dtype), _weight(rng, w_shape, blocks)
    norms = jnp.asarray(1.0 + 0.5 * rng.normal(size=(3, x_shape[-1])), jnp.float32)
    run = jax.jit(lambda x, w, norm: einsum(spec, x, w, norm=norm, norm_eps=1e-6, interpret=True))
    for norm in (norms[1], LayerOf(norms, jnp.int32(1))):
        _assert_close(spec, run(x, w, norm), rms_norm(x, norms[1], 1e-6), w)
        jaxpr = jax.make_jaxpr(run)(x, w, norm).jaxpr
        (call,) = _pallas_calls(jaxpr)
        if call.params["name"] == "grouped_matmul":
            assert "rsqrt" not in _primitives_outside_kernels(jaxpr)


def _primitives_outside_kernels(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "pallas_call":
            names.add(eqn.primitive.name)
            for sub in jaxprs_in_params(eqn.params):
                names |= _primitives_outside_kernels(sub)
    return names
