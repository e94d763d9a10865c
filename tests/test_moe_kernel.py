"""kernels.moe: the CPU forms of the grouped matmul (per-row gather, tiled) equal jax.lax.ragged_dot, including
empty groups and rows past the last group (which come out zero)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.moe import gathered_matmul, grouped_matmul, tiled_matmul


@pytest.mark.parametrize("seed", range(12))
def test_cpu_forms_equal_ragged_dot(seed):
    rng = np.random.default_rng(seed)
    m, e = int(rng.integers(1, 200)), int(rng.integers(1, 20))
    x = jnp.asarray(rng.normal(size=(m, 12)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(e, 12, 5)), jnp.float32)
    # Skewed group sizes (many empty groups), and some rows in no group.
    sizes = jnp.asarray(rng.multinomial(int(rng.integers(0, m + 1)), rng.dirichlet(np.full(e, 0.3))), jnp.int32)
    expected = np.asarray(jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32))
    grouped = np.asarray(grouped_matmul(x, w, sizes))
    for got in (grouped, gathered_matmul(x, w, sizes), tiled_matmul(x, w, sizes, tile=int(rng.choice([1, 3, 8, 32])))):
        np.testing.assert_allclose(np.asarray(got), expected, atol=1e-4, rtol=1e-5)
    assert not grouped[int(sizes.sum()):].any()
