"""kernels.pallas.sinkhorn: the Pallas Sinkhorn (interpret=True on CPU) equals the reference kernels.mhc.sinkhorn for
decode- and prefill-shaped inputs, row counts that are not a multiple of the block, peaked and flat logits; its
result is doubly stochastic; it refuses a matrix Triton cannot block. Compiling it for a GPU: tests/test_gpu_aot.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.mhc import sinkhorn as reference
from jaxserve.kernels.pallas.sinkhorn import sinkhorn

ITERS, EPS = 20, 1e-6
# Float32 both; the kernel's sums over 4 values may associate differently: a few ulps after 20 iterations.
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "shape, scale",
    [((1, 1, 4, 4), 1.0), ((8, 1, 4, 4), 4.0), ((3, 37, 4, 4), 1.0), ((130, 4, 4), 8.0), ((2, 5, 2, 2), 0.01)],
)
def test_pallas_sinkhorn_equals_the_reference(shape, scale):
    logits = jnp.asarray(np.random.default_rng(len(shape) + shape[0]).normal(size=shape) * scale, jnp.float32)
    want = reference(logits, ITERS, EPS)
    got = sinkhorn(logits, ITERS, EPS, interpret=True, block_rows=16)
    assert got.shape == logits.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
    np.testing.assert_allclose(np.asarray(got).sum(axis=-2), 1.0, atol=1e-3)  # columns, normalised last


def test_a_matrix_triton_cannot_block_is_refused():
    with pytest.raises(ValueError, match="power-of-two"):
        sinkhorn(jnp.zeros((2, 3, 3)), ITERS, EPS, interpret=True)
