"""Log-probabilities on the device, from the logits the sampler uses: the raw model distribution (log-softmax of
the float32 logits, before temperature, top-k or top-p, as vLLM reports them by default).

Only `[rows, k]` values and ids (and each row's own token's logprob) leave the device, never a vocabulary row.

- `sampled_logprobs`: at each row's last position, for the token just sampled there. Computed in every step (a
  log-softmax and a top-k over the logits the sampler already holds): a branch on whether a row asked would make
  a GPU copy its predicate to the host and wait, every decode step; the host copies only the rows that asked.
- `prompt_logprobs`: at every position of a prefill chunk, for the prompt token that follows it. The head is
  applied to the chunk's hidden states a block of positions at a time, so the logits held at once stay at
  `PROMPT_LOGITS_TOKENS` rows of the vocabulary, whatever the chunk length. That is a chunk's worth of head
  matmuls, so it sits behind a `lax.cond` on whether a row asked; only prefill groups have it (decode rows have no
  prompt tokens), so no decode step branches.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.table import REFERENCE_KERNELS, Kernels
from jaxserve.model.forward import vocab_logits
from jaxserve.request import MAX_LOGPROBS, TokenLogprob

F32 = jnp.float32
PROMPT_LOGITS_TOKENS = 512  # rows x positions of logits one block of prompt logprobs holds
# The most values one top_k call takes: XLA:GPU's top-k kernel takes up to 16, and a larger k there sorts the whole
# vocabulary of every row (seen in the optimized HLO for an H200).
TOP_K_CALL = 16


@jax.tree_util.register_dataclass
@dataclass
class LogprobInputs:
    """What one group of rows asks for: `sampled` [b] bool (the sampled token's logprobs), and for prefill groups
    `prompt` [b] bool with `targets` [b, t] int32, the prompt token after each position (None for decode groups)."""

    sampled: jax.Array
    prompt: jax.Array | None = None
    targets: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclass
class Logprobs:
    """`token` [...]: the logprob of the token asked about; `top_ids`, `top` [..., K]: the K best, best first."""

    token: jax.Array
    top_ids: jax.Array
    top: jax.Array


def _logprobs_of(logits: jax.Array, tokens: jax.Array) -> Logprobs:
    """logits [..., V] float32, tokens [...] -> their Logprobs: log-softmax values, (x - max) - log(sum(exp(x - max))),
    computed for the token and the top K only. The top K are the logits' own (the log-softmax keeps their order), and
    the best of them is the max, so no log-softmax of the whole vocabulary is written and no pass looks for the max;
    a token that is the best has exactly the best value."""
    top_logits, top_ids = _top_k(logits, min(MAX_LOGPROBS, logits.shape[-1]))
    # The max of the K, not their first: XLA reads a first element off the sort that top_k starts as, and a sort with
    # a second reader never becomes a top-k (XLA:CPU then sorts the whole vocabulary: 0.82 ms a row, not 0.02).
    best = jax.lax.stop_gradient(jnp.max(top_logits, axis=-1, keepdims=True))
    log_sum = jnp.log(jnp.sum(jnp.exp(logits - best), axis=-1, keepdims=True))
    token = (jnp.take_along_axis(logits, tokens[..., None], axis=-1) - best - log_sum)[..., 0]
    return Logprobs(token=token, top_ids=top_ids.astype(jnp.int32), top=top_logits - best - log_sum)


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k(x, k) over the last axis, exactly (ties to the lower id, as it), in calls of at most TOP_K_CALL: each
    next call sees the values the calls before it took set to -inf."""
    values, ids = jax.lax.top_k(x, min(k, TOP_K_CALL))
    if k <= TOP_K_CALL:
        return values, ids
    rest = jnp.put_along_axis(x, ids, -jnp.inf, axis=-1, inplace=False)
    more_values, more_ids = _top_k(rest, k - TOP_K_CALL)
    return jnp.concatenate([values, more_values], axis=-1), jnp.concatenate([ids, more_ids], axis=-1)


def _when_asked(asked: jax.Array, compute, shape: tuple[int, ...], k: int) -> Logprobs:
    def skip(_) -> Logprobs:
        return Logprobs(
            token=jnp.zeros(shape, F32), top_ids=jnp.zeros((*shape, k), jnp.int32), top=jnp.zeros((*shape, k), F32)
        )

    return jax.lax.cond(jnp.any(asked), lambda _: compute(), skip, None)


def sampled_logprobs(logits: jax.Array, tokens: jax.Array) -> Logprobs:
    """logits [b, V] float32 (the sampler's), tokens [b] sampled from them -> Logprobs [b]."""
    return _logprobs_of(logits.astype(F32), tokens)


def prompt_logprobs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    asked: jax.Array,
    vocab_size: int,
    kernels: Kernels = REFERENCE_KERNELS,
) -> Logprobs:
    """hidden [b, t, d] (final-normed), head [d, V] (V: `vocab_size` and any padding), targets [b, t] -> Logprobs
    [b, t] of each target at the position before it, over the real vocabulary (zeros unless asked). Batch-invariant
    (`kernels.row_tile`): position by position in the kernels' fixed tiles, whatever the rows and chunk."""
    rows, length, dim = hidden.shape
    if kernels.row_tile is not None:

        def tile(h: jax.Array, t: jax.Array) -> Logprobs:
            return _logprobs_of(vocab_logits(h, head, vocab_size), t)

        return _when_asked(
            asked, lambda: kernels.rows(tile, hidden, targets, lead=2), (rows, length), min(MAX_LOGPROBS, vocab_size)
        )
    block = max(1, min(length, PROMPT_LOGITS_TOKENS // rows))
    blocks = -(-length // block)
    pad = blocks * block - length

    def compute() -> Logprobs:
        h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(rows, blocks, block, dim).swapaxes(0, 1)
        t = jnp.pad(targets, ((0, 0), (0, pad))).reshape(rows, blocks, block).swapaxes(0, 1)

        def one_block(args) -> Logprobs:
            h_block, t_block = args
            return _logprobs_of(vocab_logits(h_block, head, vocab_size), t_block)

        out = jax.lax.map(one_block, (h, t))  # [blocks, b, block, ...]
        return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(rows, blocks * block, *x.shape[3:])[:, :length], out)

    return _when_asked(asked, compute, (rows, length), min(MAX_LOGPROBS, vocab_size))


def to_host(token_ids, token: np.ndarray, top_ids: np.ndarray, top: np.ndarray, k: int) -> list[TokenLogprob]:
    """Host records for consecutive positions of one row: `token_ids[i]` with `token[i]`, and the first `k` of
    `top_ids[i]` / `top[i]`."""
    return [
        TokenLogprob(int(t), float(v), tuple(zip(ids[:k].tolist(), values[:k].tolist())))
        for t, v, ids, values in zip(token_ids, token, top_ids, top)
    ]
