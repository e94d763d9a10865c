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
    # Prefill and verify groups only (None: a decode group, whose rows read and write their slots): the state row
    # each row's sequence state is read from (its slot, or a prefix snapshot it starts from), and the state rows
    # that also get its state as of `snapshot_lengths` tokens into the chunk (out of range: none). A prefill row
    # writes at most one snapshot (the prefix cache's), a verify row one per draft (speculative decoding's).
    read_rows: jax.Array | None = None  # [b] int32
    snapshot_rows: jax.Array | None = None  # [b, j] int32
    snapshot_lengths: jax.Array | None = None  # [b, j] int32, in [0, length]
    # [b, n] int32: the token ids right before each row's first, oldest first (-1: before the sequence's start), for
    # DeepSeek-V4.1's Engram hashes; None where nothing reads them
    context: jax.Array | None = None

    @property
    def state_source(self) -> jax.Array:
        """The state row each row reads its sequence state from."""
        return self.slots if self.read_rows is None else self.read_rows

    @property
    def query_positions(self) -> jax.Array:
        return self.positions[:, None] + jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :]

    @property
    def token_mask(self) -> jax.Array:
        return jnp.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]
