"""Fixed tiles of rows: what batch-invariant serving (`--batch-invariant`) runs every row-wise computation through.

XLA picks a computation's kernels, its blocking and its vectorisation from the shapes it sees: on CPU a matmul of 1,
2 or 64 rows sums a row's products in different orders, and even a softmax or an RMS norm over the same row comes
out different in the last bit once the batch has more rows (measured: docs/architecture.md, "Batch-invariant
serving"). A row's result then depends on its batch. `rowwise` instead cuts the rows into tiles of a fixed size
(padding the last), and maps one compiled body over them: every operation inside sees the same shapes whatever the
batch, so a row's bits depend on its own inputs only, not on how many rows came with it, where it sits in its
tile, or what its neighbours hold. Optimisation barriers keep XLA from fusing the body with the work around it and
from seeing the loop's trip count (a known one lets it unroll the loop, or inline a one-tile loop); the steps are
compiled without loop-invariant code motion (`Kernels.compiler_options`), so nothing moves out of the body either.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# Rows a tile holds when batch-invariant: a decode batch of up to 16 rows is one tile, and a tile's matmuls are no
# longer matrix-vector products.
ROW_TILE = 16


def rowwise(fn: Callable[..., Any], arrays: tuple[Any, ...], lead: int, tile: int) -> Any:
    """fn(*arrays) computed `tile` rows at a time. Every leaf of `arrays` (pytrees allowed; None stays None) has the
    same `lead` leading axes, whose N = product rows `fn` treats independently; fn sees them as `lead` axes again
    ([tile] for lead 1, [1, tile] for lead 2) and returns leaves with those leading axes, which come back as the
    original's. The padding rows are zeros; their results are dropped."""
    leaves = [leaf for leaf in jax.tree.leaves(arrays) if leaf is not None]
    shape = leaves[0].shape[:lead]
    rows = math.prod(shape)
    tiles = -(-rows // tile)
    view = (1,) * (lead - 1) + (tile,)

    def cut(a: jax.Array) -> jax.Array:
        flat = a.reshape(rows, *a.shape[lead:])
        flat = jnp.pad(flat, ((0, tiles * tile - rows),) + ((0, 0),) * (flat.ndim - 1))
        return flat.reshape(tiles, *view, *a.shape[lead:])

    tiled = jax.tree.map(cut, arrays)
    first = jax.tree.map(lambda a: a[0], tiled)
    out = jax.tree.map(lambda r: jnp.zeros((tiles, *r.shape), r.dtype), jax.eval_shape(fn, *first))

    def body(i: jax.Array, out: Any) -> Any:
        one = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tiled)
        result = jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(one)))
        return jax.tree.map(lambda o, r: jax.lax.dynamic_update_index_in_dim(o, r, i, 0), out, result)

    # The tile count hidden behind a barrier: XLA can neither unroll the loop nor inline a one-tile loop, either of
    # which would let it compile the body with what surrounds it, differently for different batches.
    out = jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(tiles)), body, out)
    return jax.tree.map(
        lambda a: a.reshape(tiles * tile, *a.shape[lead + 1 :])[:rows].reshape(*shape, *a.shape[lead + 1 :]), out
    )
