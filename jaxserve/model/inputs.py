"""The small int32 arrays that describe one step: which rows, which tokens, where they sit."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    tokens: jax.Array  # [b, t] int32; a row's chunk, padded to the bucket length
    positions: jax.Array  # [b] int32, absolute position of each row's first token
    lengths: jax.Array  # [b] int32, valid tokens per row (0 marks a padding row, which writes nothing)
    slots: jax.Array  # [b] int32, the row's cache slot (in range also for padding rows)
    page_table: jax.Array  # [b, max_pages_per_seq] int32, the row's KV pages in order

    @property
    def query_positions(self) -> jax.Array:
        return self.positions[:, None] + jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :]

    @property
    def token_mask(self) -> jax.Array:
        return jnp.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]
