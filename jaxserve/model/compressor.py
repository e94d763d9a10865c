"""The KV compressor (CSA and HCA, and the indexer's own): gated softmax pooling of m-token windows.

A chunk of `len` tokens at absolute positions pos..pos+len-1 is appended to the row's partial window;
every window that becomes complete emits one entry (RMS-normed, then RoPE at the window's first token).
For the overlapped kind (ratio-4 CSA) entry w pools the A-half of window w-1 and the B-half of window w.

Letters: b rows, t chunk time, i time in the window-aligned sequence, w windows, s slots, c entry width.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.norm import rms_norm
from jaxserve.kernels.rope import apply_rope
from jaxserve.kernels.table import REFERENCE_KERNELS, Kernels
from jaxserve.model.cache import CompressorState
from jaxserve.model.weights import Compressor

F32 = jnp.float32


@dataclass
class NewEntries:
    values: jax.Array  # [b, w, c] float32, normed and rotated
    index: jax.Array  # [b, w] int32, absolute entry index (window number)
    valid: jax.Array  # [b, w] bool, the window completed in this chunk


def compress_chunk(
    x: jax.Array,  # [b, t, d], the normalised block input
    weights: Compressor,
    state: CompressorState,  # the rows' state, gathered by slot: buf [b, m, coff*c], prev [b, m, c]
    positions: jax.Array,  # [b] int32, absolute position of the chunk's first token
    lengths: jax.Array,  # [b] int32, valid tokens in the chunk
    rate: int,
    freqs: np.ndarray,
    eps: float,
    snapshot_lengths: jax.Array | None = None,  # [b, j] int32: also return the states this many tokens in
    rotate: bool = True,  # False: the entries come out unrotated (DeepSeek-V4.1 derives its indexer keys from them)
    kernels: Kernels = REFERENCE_KERNELS,  # its `rows`: the projections token by token, the pooling window by window
) -> tuple[NewEntries, CompressorState, list[CompressorState]]:
    m = rate
    overlap = state.overlap
    c = weights.norm.shape[0]
    b, t, _ = x.shape
    n_windows = (m - 1 + t) // m + 1  # enough to hold the partial window plus the whole chunk
    span = n_windows * m

    def project(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        xf = x.astype(F32)
        return (
            jnp.einsum("btd,df->btf", xf, weights.wkv.astype(F32)),
            jnp.einsum("btd,df->btf", xf, weights.wgate.astype(F32)),
        )

    with jax.named_scope("project"):
        kv, gate = kernels.rows(project, x, lead=2)

    with jax.named_scope("align_windows"):
        # Sequence index i holds absolute position (pos // m) * m + i: the buffered tokens, then the chunk.
        offset = positions % m
        i = jnp.arange(span)[None, :]
        src = i - offset[:, None]  # chunk time of sequence index i
        from_buffer = i < offset[:, None]
        src_clipped = jnp.clip(src, 0, t - 1)
        chunk_kv = jnp.take_along_axis(kv, src_clipped[..., None], axis=1)
        chunk_gate = jnp.take_along_axis(gate, src_clipped[..., None], axis=1)
        if weights.ape is not None:  # DeepSeek-V4.1's compressor has no position bias
            chunk_gate += jnp.tile(weights.ape.astype(F32), (n_windows, 1))[None]  # [span, f]: slot i % m
        pad = ((0, 0), (0, span - m), (0, 0))
        seq_kv = jnp.where(from_buffer[..., None], jnp.pad(state.buf_kv, pad), chunk_kv)
        seq_gate = jnp.where(from_buffer[..., None], jnp.pad(state.buf_gate, pad), chunk_gate)
        win_kv = seq_kv.reshape(b, n_windows, m, -1)
        win_gate = seq_gate.reshape(b, n_windows, m, -1)

    first_window = positions // m
    window_index = first_window[:, None] + jnp.arange(n_windows)[None, :]  # [b, w]

    with jax.named_scope("pool"):
        if overlap:
            assert state.prev_kv is not None and state.prev_gate is not None  # what `overlap` says
            ext_kv = jnp.concatenate([state.prev_kv[:, None], win_kv[..., :c]], axis=1)  # [b, w+1, m, c]
            ext_gate = jnp.concatenate([state.prev_gate[:, None], win_gate[..., :c]], axis=1)
            # Window 0 of a sequence has no predecessor: its A-slots get zero weight.
            a_gate = jnp.where((window_index == 0)[..., None, None], -jnp.inf, ext_gate[:, :-1])
            slots_kv = jnp.concatenate([ext_kv[:, :-1], win_kv[..., c:]], axis=2)  # [b, w, 2m, c]
            slots_gate = jnp.concatenate([a_gate, win_gate[..., c:]], axis=2)
        else:
            slots_kv, slots_gate = win_kv, win_gate

        def pool(slots_gate: jax.Array, slots_kv: jax.Array, window_index: jax.Array) -> jax.Array:
            pooled = jnp.sum(jax.nn.softmax(slots_gate, axis=2) * slots_kv, axis=2)  # [b, w, c]
            pooled = rms_norm(pooled, weights.norm, eps)
            return apply_rope(pooled, window_index * m, freqs) if rotate else pooled

        values = kernels.rows(pool, slots_gate, slots_kv, window_index, lead=2)

    def state_after(tokens: jax.Array) -> CompressorState:
        """The rows' state once `tokens [b]` of the chunk are in."""
        pick = ((offset + tokens) // m)[:, None, None, None]  # the sequence window holding the partial window
        parts = [win_kv, win_gate] + ([ext_kv, ext_gate] if overlap else [])
        return CompressorState.pack(*(jnp.take_along_axis(part, pick, axis=1)[:, 0] for part in parts))

    with jax.named_scope("carry_state"):
        new_state = state_after(lengths)
        snapshots = [] if snapshot_lengths is None else [state_after(n) for n in snapshot_lengths.T]

    valid = jnp.arange(n_windows)[None, :] < ((offset + lengths) // m)[:, None]  # the windows completed by now
    return NewEntries(values=values, index=window_index.astype(jnp.int32), valid=valid), new_state, snapshots
