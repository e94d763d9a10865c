"""Token sampling on device: greedy, temperature, top-k, top-p, per-request seeds.

Each row's randomness comes from its own (seed, position) pair, so a request's tokens do not depend on which
other requests share its batch, nor on the batch size or row order.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclass
class SamplingArrays:
    temperature: jax.Array  # [b] f32; 0 means greedy
    top_k: jax.Array  # [b] int32; <= 0 means off
    top_p: jax.Array  # [b] f32 in (0, 1]
    seed: jax.Array  # [b] uint32
    position: jax.Array  # [b] int32, the position of the token being sampled (its key's second half)

    @staticmethod
    def build(temperature, top_k, top_p, seed, position) -> "SamplingArrays":
        return SamplingArrays(
            temperature=np.asarray(temperature, np.float32), top_k=np.asarray(top_k, np.int32),
            top_p=np.asarray(top_p, np.float32), seed=np.asarray(seed, np.uint32),
            position=np.asarray(position, np.int32),
        )


def _filter_row(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (to -inf) everything outside the top-k and outside the smallest top-p nucleus of one row."""
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits)[::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = sorted_logits[k - 1]
    probs = jax.nn.softmax(jnp.where(jnp.arange(vocab) < k, sorted_logits, -jnp.inf))
    before = jnp.cumsum(probs) - probs  # probability mass strictly ahead of each sorted token
    last_kept = jnp.maximum(jnp.sum(before < top_p) - 1, 0)
    threshold = jnp.maximum(kth, sorted_logits[last_kept])
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """logits [b, V] float32 -> token ids [b] int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def one_row(row_logits, temperature, top_k, top_p, seed, position):
        key = jax.random.fold_in(jax.random.key(seed), position)
        scaled = row_logits / jnp.maximum(temperature, 1e-6)
        return jax.random.categorical(key, _filter_row(scaled, top_k, top_p)).astype(jnp.int32)

    sampled = jax.vmap(one_row)(logits.astype(F32), params.temperature, params.top_k, params.top_p, params.seed,
                                params.position)
    return jnp.where(params.temperature > 0, sampled, greedy)
