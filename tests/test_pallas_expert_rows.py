"""kernels.pallas.expert_rows (interpret mode on CPU) equals the reference kernels.moe.expert_rows on every row that has
an expert: float32, bfloat16, FP8 and FP4 stacks, one stack or gate and up with the clamped SwiGLU, rows sharing an
expert (in any order, not adjacent), rows of another device's expert (-1) or past the stack, one row, an odd count and
the most it takes, d and f that are not multiples of the tiles; it refuses more rows than that and mismatched gate / up
stacks; and the shared expert's gated_matmul through it (a projection pair or a layer of a stack, up to the most rows it
takes, the reference's form past that). Its HBM statement: tests/test_hlo_profile.py; compiled for an H200 in the
model's every step: tests/test_plan_target.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.moe import EXPERT_ROWS_MAX, expert_rows, gated_matmul
from jaxserve.kernels.pallas.expert_rows import expert_rows as kernel
from jaxserve.kernels.pallas.expert_rows import gated_matmul as gated_kernel
from jaxserve.kernels.quant import FP4, FP8, LayerOf, Quantized, quantize

N, D, F = 12, 70, 45  # two layers of 6 experts; d and f not multiples of any tile (FP4 needs an even d)
LIMIT = 7.0
reference = jax.jit(expert_rows, static_argnames=("swiglu_limit", "out_dtype", "repeats"))


def _stack(fmt: str, seed: int):
    rng = np.random.default_rng(seed)
    dense = jnp.asarray(rng.normal(size=(N, D, F)) * rng.uniform(0.1, 3, size=(N, 1, F)), jnp.float32)
    if fmt in ("float32", "bfloat16"):
        return dense.astype(fmt)
    return quantize(dense, fmt, (1, 128, 128) if fmt == FP8 else (1, 32, 1))


ROUTINGS = {
    "one row": [7],
    "shared experts, odd count": [3, 9, 3, 0, 11, 9, 9, 5, 3, 0, 1],
    "another device's rows": [-1, 4, -1, 4, 12, 2, -1],  # -1 and 12 (past the stack): no expert here
    "the most rows": list(np.random.default_rng(0).integers(-1, N, EXPERT_ROWS_MAX)),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", FP8, FP4])
@pytest.mark.parametrize("swiglu", [False, True])
def test_pallas_expert_rows_equals_the_reference(routing, fmt, swiglu):
    experts = jnp.asarray(ROUTINGS[routing], jnp.int32)
    dtype = jnp.float32 if fmt == "float32" else jnp.bfloat16
    x = jnp.asarray(np.random.default_rng(len(experts)).normal(size=(len(experts), D)), dtype)
    stacks = (_stack(fmt, 1), _stack(fmt, 2)) if swiglu else (_stack(fmt, 3),)
    limit = LIMIT if swiglu else None
    got = np.asarray(kernel(x, stacks, experts, swiglu_limit=limit, interpret=True, block_k=32, block_f=16))
    want = np.asarray(reference(x, stacks, experts, swiglu_limit=limit))
    valid = (np.asarray(experts) >= 0) & (np.asarray(experts) < N)
    assert got.shape == want.shape == (len(experts), F) and valid.any()
    # Float32 sums in another order (k tiles, FP4's even / odd split), then the SwiGLU: relative to the magnitudes.
    np.testing.assert_allclose(got[valid], want[valid], rtol=2e-5, atol=2e-5 * np.abs(want[valid]).max())
    assert np.abs(want[valid]).max() > 1.0


@pytest.mark.parametrize("fmt", ["bfloat16", FP8, FP4])
def test_a_tokens_assignments_read_its_row_in_place(fmt):
    """`repeats`: each row of x serves that many consecutive assignments (a token's top-k), as the model calls it:
    the same result as the row repeated, in the kernel and the reference alike; a count that does not match is
    refused."""
    k = 3
    experts = jnp.asarray(ROUTINGS["shared experts, odd count"][:9], jnp.int32)
    x = jnp.asarray(np.random.default_rng(9).normal(size=(len(experts) // k, D)), jnp.bfloat16)
    stacks = (_stack(fmt, 1), _stack(fmt, 2))
    repeated = jnp.repeat(x, k, axis=0)
    got = np.asarray(kernel(x, stacks, experts, swiglu_limit=LIMIT, repeats=k, interpret=True, block_k=32, block_f=16))
    want = np.asarray(kernel(repeated, stacks, experts, swiglu_limit=LIMIT, interpret=True, block_k=32, block_f=16))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        np.asarray(reference(x, stacks, experts, swiglu_limit=LIMIT, repeats=k)),
        np.asarray(reference(repeated, stacks, experts, swiglu_limit=LIMIT)),
    )
    with pytest.raises(ValueError, match="9 expert indices for 3 rows of x, each 2 times"):
        kernel(x, stacks, experts, swiglu_limit=LIMIT, repeats=2, interpret=True)


def test_too_many_rows_and_mismatched_stacks_are_refused():
    x = jnp.zeros((EXPERT_ROWS_MAX + 1, D), jnp.float32)
    with pytest.raises(ValueError, match=f"at most {EXPERT_ROWS_MAX} rows"):
        kernel(x, (_stack("float32", 0),), jnp.zeros(len(x), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="one stack, or two"):
        kernel(x[:4], (_stack("float32", 0), _stack("float32", 1)), jnp.zeros(4, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="one shape and format"):
        kernel(x[:4], (_stack("float32", 0), _stack(FP8, 1)), jnp.zeros(4, jnp.int32), swiglu_limit=LIMIT,
               interpret=True)  # fmt: skip


@pytest.mark.parametrize("rows", [1, 8, EXPERT_ROWS_MAX + 3])  # the last: more rows than the kernel takes
@pytest.mark.parametrize("fmt, stacked", [("bfloat16", False), (FP8, False), (FP8, True)])  # the model's LayerOfs
def test_the_shared_experts_gated_matmul_equals_the_reference(rows, fmt, stacked):
    """Gate, up and the SwiGLU of a shared expert (one projection pair, or a layer of a segment's stack as the model
    passes it): the kernel rounds once after the SwiGLU where the reference rounds each product to x's dtype."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.normal(size=(rows, D)), jnp.bfloat16)
    layers = [[jnp.asarray(rng.normal(size=(D, F)), jnp.float32) for _ in range(2)] for _ in range(3)]
    weights = [jnp.stack([layer[i] for layer in layers]) for i in range(2)]  # [3, D, F] each
    if fmt == FP8:  # a stack of 2-D weights with the release's 128 x 128 blocks, as the loader stacks them
        weights = [quantize(w, FP8, (1, 128, 128)) for w in weights]
        weights = [Quantized(w.codes, w.scales, FP8, (128, 128)) for w in weights]
    if stacked:
        gate, up = (LayerOf(w, jnp.int32(1)) for w in weights)
    else:
        gate, up = (jax.tree.map(lambda a: a[1], w) for w in weights)
    got = np.asarray(gated_kernel(x, gate, up, LIMIT, interpret=True), np.float32)
    want = np.asarray(gated_matmul(x, gate, up, LIMIT), np.float32)
    assert got.shape == (rows, F) and np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=2**-6 * np.abs(want).max())
