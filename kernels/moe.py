"""Grouped expert matmul: rows sorted by expert, each group multiplied by its own expert's matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [m, d] (rows sorted by group), w [e, d, f], group_sizes [e] (sum <= m) -> [m, f]; float32 accumulation."""
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
