"""kernels.pallas.grouped_matmul (interpret mode on CPU) equals the pure-JAX reference kernels.moe.grouped_matmul
and jax.lax.ragged_dot on the dequantized stack: every storage format (float32, bfloat16, FP8, FP4), ragged and
empty groups, all rows on one expert, the first and last experts, expert offsets into a stack of two layers'
experts (as the model passes them), rows past the last group (zero), 1, 8 and an odd
number of rows, d and f that are not multiples of the tiles, several k / f / row tiles, every FP8 byte and every
FP4 nibble in both nibble positions, and the scale bytes 0, 1, 127, 254 and 255 (NaN); and that it compiles for an
H200 (deviceless: Triton and ptxas, no GPU), alone and under expert parallelism.

Shapes are shared between tests so that the interpret-mode kernels compile once per configuration."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.kernels.moe import grouped_matmul
from jaxserve.kernels.norm import rms_norm
from jaxserve.kernels.pallas.grouped_matmul import grouped_matmul as kernel
from jaxserve.kernels.quant import FP4, FP8, Quantized, dequantize, quantize
from jaxserve.runner.targets import compile_for_target, target_devices

M, E = 37, 6  # an odd row count: 3 row tiles of 16 (the auto block_m for 37 rows over 6 groups), the last partial
N = 2 * E  # experts in a stack: two layers of E, group g of the second layer uses expert E + g
D, F = 75, 45  # neither a multiple of any tile; FP4 needs an even d: D_FP4
D_FP4 = 70
FP8_BLOCKS, FP4_BLOCKS = (1, 128, 128), (1, 32, 1)

# Compiled once per shape: op by op, the references would take most of this file's time.
reference = jax.jit(grouped_matmul)
_dequantize = jax.jit(dequantize, static_argnums=1)
_ragged_dot = jax.jit(functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32))

# Group sizes over E experts (rows sorted by group). Sums <= M; rows past the sum belong to no group.
LAYOUTS = {
    "ragged, empty groups": [10, 0, 15, 0, 3, 9],
    "all rows on one expert": [0, 0, M, 0, 0, 0],
    "first and last expert": [20, 0, 0, 0, 0, 17],
    "rows past the last group": [5, 0, 7, 0, 0, 11],
    "one row per expert": [1, 1, 1, 1, 1, 1],
    "no rows routed": [0, 0, 0, 0, 0, 0],
}


def _stack(fmt: str, rng: np.random.Generator, d: int, f: int = F):
    """A random expert stack [N, d, f]: float32 / bfloat16 arrays, or FP8 / FP4 quantized with the release's
    blocks (so scales differ from block to block)."""
    dense = jnp.asarray(rng.normal(size=(N, d, f)) * rng.uniform(0.1, 10, size=(N, 1, f)), jnp.float32)
    if fmt == "float32":
        return dense
    if fmt == "bfloat16":
        return dense.astype(jnp.bfloat16)
    return quantize(dense, fmt, FP8_BLOCKS if fmt == FP8 else FP4_BLOCKS)


def _dense(w, dtype) -> np.ndarray:
    return np.asarray(_dequantize(w, dtype) if isinstance(w, Quantized) else w, np.float64)


def _check(x, w, sizes, offset: int, **blocks) -> np.ndarray:
    """The kernel against the reference and ragged_dot on the dequantized experts [offset, offset + E); rows in no
    group exactly zero."""
    sizes, offset_array = jnp.asarray(sizes, jnp.int32), jnp.asarray(offset, jnp.int32)  # traced, as in the model
    got = np.asarray(kernel(x, w, sizes, offset_array, interpret=True, **blocks))
    dense = _dense(w, x.dtype)[offset : offset + len(sizes)]
    # Float32 accumulation in another order (k tiles, FP4's even/odd split): each of the d additions rounds by at
    # most 2^-24 of a partial sum bounded by sum_k |x w|. bfloat16 inputs add nothing: their products are exact in
    # float32 and every side rounds the decoded weights to bfloat16 the same way (exactly: codes times powers of 2).
    group = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
    magnitude = np.zeros(got.shape)
    magnitude[: len(group)] = np.einsum(
        "md,mdf->mf", np.abs(np.asarray(x, np.float64))[: len(group)], np.nan_to_num(np.abs(dense[group]), posinf=0)
    )
    tolerance = x.shape[1] * 2.0**-24 * magnitude
    oracles = [np.asarray(reference(x, w, sizes, offset_array))]
    if np.isfinite(dense).all():  # XLA:CPU's ragged_dot is dense (all rows times all experts): NaN reaches all rows
        oracles.append(np.asarray(_ragged_dot(x, jnp.asarray(dense, x.dtype), sizes)))
    for expected in oracles:
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        finite = ~np.isnan(expected)
        assert (np.abs(got - expected)[finite] <= tolerance[finite]).all(), np.abs(got - expected).max()
    assert not got[len(group) :].any()  # rows in no group
    return got


def _rows(rng: np.random.Generator, m: int, d: int, dtype) -> jax.Array:
    return jnp.asarray(rng.normal(size=(m, d)), dtype)


@pytest.mark.parametrize(
    "fmt,x_dtype", [("float32", jnp.float32), ("bfloat16", jnp.bfloat16), (FP8, jnp.float32), (FP4, jnp.bfloat16)]
)
def test_group_layouts(fmt, x_dtype):
    rng = np.random.default_rng(0)
    d = D_FP4 if fmt == FP4 else D
    x, w = _rows(rng, M, d, x_dtype), _stack(fmt, rng, d)
    for offset in (0, E):
        for name, sizes in LAYOUTS.items():
            got = _check(x, w, sizes, offset)
            assert got[: sum(sizes)].any() == (sum(sizes) > 0), name  # routed rows produce something


@pytest.mark.parametrize("m,fmt,x_dtype", [(1, FP8, jnp.bfloat16), (8, FP4, jnp.float32)])
def test_few_rows(m, fmt, x_dtype):
    """Decode-sized steps (the reference then takes its per-row gather form for m <= e)."""
    rng = np.random.default_rng(1)
    d = D_FP4 if fmt == FP4 else D
    x, w = _rows(rng, m, d, x_dtype), _stack(fmt, rng, d)
    for sizes in ([0] * (E - 1) + [m], [m] + [0] * (E - 1), [0] * E):
        _check(x, w, sizes, E)
    if m == 8:
        _check(x, w, [3, 0, 0, 4, 0, 0], E)  # a row past the last group


@pytest.mark.parametrize("fmt", [FP8, FP4])
def test_every_row_grouped_and_the_output_dtype(fmt):
    """A caller whose groups hold every row (a projection as one expert) gets the same sums without the zeros, and an
    output dtype gets the float32 sums rounded once."""
    rng = np.random.default_rng(4)
    d = D_FP4 if fmt == FP4 else D
    x, w = _rows(rng, M, d, jnp.bfloat16), _stack(fmt, rng, d)
    sizes, offset = jnp.asarray([10, 0, 15, 0, 3, 9], jnp.int32), jnp.int32(E)  # all 37 rows
    whole = _check(x, w, sizes, E)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        got = kernel(x, w, sizes, offset, interpret=True, out_dtype=out_dtype, every_row_grouped=True)
        assert got.dtype == out_dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(whole.astype(out_dtype), np.float32))


@pytest.mark.parametrize(
    "fmt,x_dtype,d,f,blocks",
    [
        ("float32", jnp.float32, D, F, dict(block_m=16, block_k=16, block_f=16)),  # 5 k tiles, 3 f tiles, both partial
        # 2 scale rows per k tile (the last k tile's second one past the 3 of d = 260), 5 f tiles within 2 scale columns
        (FP8, jnp.bfloat16, 260, 160, dict(block_m=16, block_k=256, block_f=32)),
        (
            FP8,
            jnp.float32,
            260,
            160,
            dict(block_m=32, block_k=32, block_f=256),
        ),  # 2 scale columns per f tile, 1 partial
        (FP4, jnp.float32, 200, F, dict(block_m=16, block_k=32, block_f=16)),  # one scale row per k step, 7 steps
    ],
)  # (FP4's default block_k = 128 spans 4 scale rows: test_group_layouts)
def test_tiles_and_partial_edges(fmt, x_dtype, d, f, blocks):
    rng = np.random.default_rng(2)
    x, w = _rows(rng, M, d, x_dtype), _stack(fmt, rng, d, f)
    for sizes in (LAYOUTS["ragged, empty groups"], LAYOUTS["rows past the last group"]):
        _check(x, w, sizes, E, **blocks)


def _scales(rng: np.random.Generator, shape: tuple[int, ...]) -> jax.Array:
    """Ordinary ue8m0 scale bytes (2^-7 .. 2^3)."""
    return jnp.asarray(rng.integers(120, 131, size=shape), jnp.uint8)


def test_fp4_every_nibble_in_both_positions():
    """Codes holding every byte value: each of the 16 e2m1 codes as the low (even input) and the high (odd input)
    nibble, next to every other code. Swapping the nibbles or misreading a code fails."""
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, size=(N, D_FP4 // 2, F))
    for g in range(N):
        codes[g].reshape(-1)[:256] = rng.permutation(256)
    w = Quantized(jnp.asarray(codes, jnp.uint8), _scales(rng, (N, -(-D_FP4 // 32), F)), FP4, FP4_BLOCKS)
    x = _rows(rng, M, D_FP4, jnp.bfloat16)
    for offset in (0, E):
        _check(x, w, LAYOUTS["ragged, empty groups"], offset)
        _check(x, w, LAYOUTS["one row per expert"], offset)


def test_fp8_every_byte():
    """Codes holding every e4m3fn byte: signs, subnormals (exponent field 0), the largest (448) and the two NaN
    codes (S.1111.111), whose NaN reaches the output columns they feed exactly as in the reference."""
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 256, size=(N, D, F)).astype(np.uint8)
    for g in range(N):
        codes[g].reshape(-1)[:256] = rng.permutation(256)
    scales = _scales(rng, (N, 1, 1))
    w = Quantized(jnp.asarray(codes.view(jnp.float8_e4m3fn)), scales, FP8, FP8_BLOCKS)
    x = _rows(rng, M, D, jnp.float32)
    for offset in (0, E):
        got = _check(x, w, LAYOUTS["ragged, empty groups"], offset)
        assert np.isnan(got).any() and np.isfinite(got).any()


# One ue8m0 byte per expert (all its blocks): 2^-127 (a float32 denormal), 2^-126 (the smallest normal), 1, 2^127,
# NaN and 2. Each expert gets codes and its group gets rows such that every product and partial sum is exact in
# float32 (no rounding, no overflow of finite sums, no denormal results), so the kernel must equal the reference bit
# for bit in any summation order, infinities and NaN included.
EXTREME_SCALES = (0, 1, 127, 254, 255, 128)
ROWS_PER_GROUP = 6  # 36 of the M = 37 rows: the last is in no group
# d a multiple of block_k: no masked k padding, whose zero codes would turn a scale taken for +inf into NaN too
D_EXTREME, BLOCK_K_EXTREME = 64, 64


def _fp8_bytes(rng, shape, exponents, big_fraction=0.0) -> np.ndarray:
    """e4m3fn bytes with exponent fields in `exponents` (a range), random signs and mantissas, and a fraction of
    `big_fraction` of them >= 2 (exponent field 8..14: never NaN)."""
    exponent = np.where(rng.random(shape) < big_fraction, rng.integers(8, 15, shape), rng.integers(*exponents, shape))
    return ((rng.integers(0, 2, shape) << 7) | (exponent << 3) | rng.integers(0, 8, shape)).astype(np.uint8)


def _fp4_bytes(rng, shape, magnitudes, big_fraction=0.0) -> np.ndarray:
    """Packed e2m1 bytes whose two nibbles have magnitude codes (0..7) in `magnitudes`, random signs, and a fraction
    `big_fraction` of magnitude codes 4..7 (2, 3, 4, 6)."""

    def nibbles():
        magnitude = np.where(rng.random(shape) < big_fraction, rng.integers(4, 8, shape), rng.choice(magnitudes, shape))
        return (rng.integers(0, 2, shape) << 3) | magnitude

    return (nibbles() | (nibbles() << 4)).astype(np.uint8)


def _extreme_case(fmt: str, rng: np.random.Generator):
    """(x, w, sizes): expert g scaled by EXTREME_SCALES[g] for all its blocks, codes and rows chosen per scale:
    - 2^-127, 2^-126: codes that are whole numbers (FP8: >= 8; FP4: times x = +-2), x in {-1, 0, 1} (FP4: +-2):
      products are multiples of 2^-126, normal. (XLA:CPU treats the denormal 2^-127 as 0, so on CPU the reference and
      the kernel both give 0 for that expert; only a GPU run shows the denormal kept or flushed.)
    - 1, 2: ordinary codes (FP8: |v| <= 7.5), x multiples of 1/4 in [-1, 1]: short sums of short mantissas.
    - 2^127: codes |v| <= 1.875 * 2^-6 (FP8) or <= 1.5 (FP4) with x small enough that |finite sum| < 2 * 2^127, and
      a few codes >= 2 that decode to infinity (NaN where +inf meets -inf or x = 0).
    - NaN: positive codes and rows; the whole group comes out NaN (+inf if the scale were read as infinity)."""
    d = D_EXTREME
    codes, rows = [], []
    for u in EXTREME_SCALES:
        shape = (d // 2 if fmt == FP4 else d, F)
        if u <= 1:
            c = _fp4_bytes(rng, shape, range(8)) if fmt == FP4 else _fp8_bytes(rng, shape, (10, 15))
            x = rng.integers(-1, 2, (ROWS_PER_GROUP, d)) * (2.0 if fmt == FP4 else 1.0)
        elif u == 254:
            c = _fp4_bytes(rng, shape, range(4), 0.02) if fmt == FP4 else _fp8_bytes(rng, shape, (0, 2), 0.02)
            x = rng.integers(-4, 5, (ROWS_PER_GROUP, d)) * (2.0**-10 if fmt == FP4 else 2.0**-3)
        elif u == 255:  # positive: a NaN scale taken for infinity would give +inf instead of NaN
            c = _fp4_bytes(rng, shape, range(1, 8)) & 0x77 if fmt == FP4 else _fp8_bytes(rng, shape, (1, 10)) & 0x7F
            x = rng.integers(1, 5, (ROWS_PER_GROUP, d)) / 4
        else:
            c = _fp4_bytes(rng, shape, range(8)) if fmt == FP4 else _fp8_bytes(rng, shape, (0, 10))
            x = rng.integers(-4, 5, (ROWS_PER_GROUP, d)) / 4
        codes.append(c)
        rows.append(x)
    rows.append(rng.normal(size=(M - E * ROWS_PER_GROUP, d)))  # in no group
    codes = jnp.asarray(np.stack(codes))
    scale_rows = -(-d // (32 if fmt == FP4 else 128))
    scales = np.broadcast_to(np.asarray(EXTREME_SCALES)[:, None, None], (E, scale_rows, F if fmt == FP4 else 1))
    w = Quantized(
        codes if fmt == FP4 else jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn),
        jnp.asarray(scales, jnp.uint8),
        fmt,
        FP4_BLOCKS if fmt == FP4 else FP8_BLOCKS,
    )
    return np.concatenate(rows), w, [ROWS_PER_GROUP] * E


@pytest.mark.parametrize("fmt,x_dtype", [(FP8, jnp.float32), (FP4, jnp.bfloat16)])
def test_scale_extremes(fmt, x_dtype):
    x, w, sizes = _extreme_case(fmt, np.random.default_rng(5))
    x = jnp.asarray(x, x_dtype)  # every value above is exact in bfloat16 too
    sizes, offset = jnp.asarray(sizes, jnp.int32), jnp.asarray(0, jnp.int32)  # a stack of E experts
    got = np.asarray(kernel(x, w, sizes, offset, interpret=True, block_k=BLOCK_K_EXTREME))
    np.testing.assert_array_equal(got, np.asarray(reference(x, w, sizes, offset)))  # tolerance 0: exact arithmetic
    # The cases were built as intended (group of scale byte u -> its rows); byte 0 gives 0 on CPU, see _extreme_case.
    group = dict(zip(EXTREME_SCALES, got[: E * ROWS_PER_GROUP].reshape(E, ROWS_PER_GROUP, F)))
    assert group[1].any() and np.isfinite(group[1]).all()
    assert (np.abs(group[1][group[1] != 0]) >= np.finfo(np.float32).tiny).all()  # normal: no flushing involved
    assert group[127].any() and np.isfinite(group[127]).all() and np.isfinite(group[128]).all()
    assert np.isinf(group[254]).any() and (np.abs(group[254][np.isfinite(group[254])]) > 2.0**120).any()
    assert np.isnan(group[255]).all()
    assert not got[E * ROWS_PER_GROUP :].any()


@pytest.mark.parametrize(
    "fmt,x_dtype", [("float32", jnp.float32), ("bfloat16", jnp.bfloat16), (FP8, jnp.bfloat16), (FP4, jnp.bfloat16)]
)
def test_compiles_for_an_h200_alone_and_under_expert_parallelism(fmt, x_dtype):
    """Compiled for a deviceless H200 (Pallas' Triton lowering, Triton, ptxas: jaxserve.runner.targets), on one GPU
    and inside shard_map over 4, the experts split as the MoE splits them (the result varies over the mesh axes, which
    the kernel's output type must say). No GPU runs it."""
    rng = np.random.default_rng(8)
    d = D_FP4 if fmt == FP4 else D
    x, w = _rows(rng, M, d, x_dtype), _stack(fmt, rng, d)
    sizes, offset = jnp.asarray(LAYOUTS["ragged, empty groups"], jnp.int32), jnp.asarray(E, jnp.int32)
    one = Mesh(target_devices("h200", 1), ("x",))
    alone = compile_for_target(jax.jit(kernel), *jax.tree.map(lambda a: _on(one, a, P()), (x, w, sizes, offset)))
    assert "__gpu$xla.gpu.triton" in alone.as_text()

    four = Mesh(np.array(target_devices("h200", 4)).reshape(2, 2), ("expert", "tensor"))
    experts = P(("expert", "tensor"))

    def per_device(x, w, sizes):  # each device: its quarter of the stack, its local groups
        return jax.lax.psum(kernel(x, w, sizes), ("expert", "tensor"))

    split = jax.shard_map(per_device, mesh=four, in_specs=(P(), experts, P()), out_specs=P())
    local_sizes = sizes[: N // 4]
    args = (_on(four, x, P()), jax.tree.map(lambda a: _on(four, a, experts), w), _on(four, local_sizes, P()))
    assert "__gpu$xla.gpu.triton" in compile_for_target(jax.jit(split), *args).as_text()


def _on(mesh: Mesh, a: jax.Array, spec: P) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))


def test_bad_blocks_rejected():
    x, w = jnp.zeros((4, D_FP4), jnp.bfloat16), _stack(FP4, np.random.default_rng(7), D_FP4)
    sizes = jnp.asarray([4, 0, 0, 0, 0, 0], jnp.int32)
    for blocks in (dict(block_k=24), dict(block_k=16), dict(block_f=8), dict(block_m=48)):
        with pytest.raises(ValueError, match="power of two"):
            kernel(x, w, sizes, interpret=True, **blocks)


@pytest.mark.parametrize("fmt,x_dtype", [(FP8, jnp.bfloat16), (FP4, jnp.bfloat16), (FP4, jnp.float32)])
def test_an_input_norm_normalises_each_row_as_it_is_loaded(fmt, x_dtype):
    """x_norm (a stack of norm weights and the row to use): the result is the reference's on rms_norm(x, that row),
    FP4's even and odd input columns each meeting their own weights."""
    rng = np.random.default_rng(6)
    d = D_FP4 if fmt == FP4 else D
    x, w = _rows(rng, M, d, x_dtype), _stack(fmt, rng, d)
    norms = jnp.asarray(1.0 + 0.5 * rng.normal(size=(2, d)), jnp.float32)
    sizes, offset = jnp.asarray([10, 0, 15, 0, 3, 9], jnp.int32), jnp.int32(E)
    x_norm = (norms, jnp.ones((1,), jnp.int32))
    got = np.asarray(kernel(x, w, sizes, offset, interpret=True, x_norm=x_norm, norm_eps=1e-6))
    normed = rms_norm(x, norms[1], 1e-6)
    want = _check(normed, w, sizes, E)  # the kernel on the reference's normalised rows, checked against the reference
    # The kernel sums a row's squares in another order, so a normalised element may round to the neighbouring value
    # of x's dtype (2^-8 of it in bfloat16; in float32 a few ulps): each such term moves the sum by that much.
    group = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
    dense = np.nan_to_num(np.abs(_dense(w, x.dtype)[E : E + len(sizes)][group]), posinf=0)
    magnitude = np.einsum("md,mdf->mf", np.abs(np.asarray(normed, np.float64)), dense)
    rounding = 2.0**-8 if x_dtype == jnp.bfloat16 else 2.0**-21
    assert (np.abs(got - want) <= rounding * magnitude).all(), np.abs(got - want).max()
