"""Pallas Sinkhorn: `jaxserve.kernels.mhc.sinkhorn` as one kernel.

The reference is a loop of reductions over tiny n x n matrices: on a GPU, three kernels an iteration, 19
iterations, twice a layer (a third of a decode step's launches). Here each program takes a block of `block_rows`
matrices [bm, n, n] into registers, runs the softmax and every iteration there, and stores the result: one launch,
one read of the logits and one write of the result. The operations and their order are the reference's (max,
exp, sum, divide, + eps; then column and row sums), in float32.

Rows are padded outside the kernel to a multiple of the block (the arrays are small: 16 floats a token), so every
block is whole; n must be a power of two (Triton's block shapes are; V4's hc_mult is 4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32


@functools.partial(jax.jit, static_argnames=("iters", "eps", "interpret", "block_rows"))
def sinkhorn(logits: jax.Array, iters: int, eps: float, *, interpret: bool = False, block_rows: int = 64) -> jax.Array:
    """[..., n, n] -> [..., n, n] float32, as the reference."""
    n = logits.shape[-1]
    if n & (n - 1) or logits.shape[-2] != n:
        raise ValueError(f"the Pallas Sinkhorn takes square matrices of a power-of-two size; got {logits.shape[-2:]}")
    flat = logits.reshape(-1, n, n).astype(F32)
    rows = flat.shape[0]
    bm = min(block_rows, pl.next_power_of_2(rows))
    padded = pl.cdiv(rows, bm) * bm
    flat = jnp.pad(flat, ((0, padded - rows), (0, 0), (0, 0)))
    spec = pl.BlockSpec((bm, n, n), lambda i: (i, 0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, iters=iters, eps=eps),
        out_shape=jax.ShapeDtypeStruct(flat.shape, F32),
        grid=(padded // bm,),
        in_specs=[spec],
        out_specs=spec,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="sinkhorn",
    )(flat)
    return out[:rows].reshape(logits.shape)


def _kernel(logits_ref, out_ref, *, iters: int, eps: float):
    m = logits_ref[...]
    m = jnp.exp(m - jnp.max(m, axis=-1, keepdims=True))
    m = m / jnp.sum(m, axis=-1, keepdims=True) + eps
    m = m / (jnp.sum(m, axis=-2, keepdims=True) + eps)

    def row_then_column(_, m):
        m = m / (jnp.sum(m, axis=-1, keepdims=True) + eps)
        return m / (jnp.sum(m, axis=-2, keepdims=True) + eps)

    out_ref[...] = lax.fori_loop(0, iters - 1, row_then_column, m)
