"""Token sampling on device: vLLM's repetition, frequency and presence penalties, logit biases, token masks
(structured outputs, allowed_token_ids), greedy, temperature, min-p, top-k, top-p, per-request seeds.

Each row's randomness comes from its own (seed, position) pair, so a request's tokens do not depend on which
other requests share its batch, nor on the batch size or row order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.request import MAX_LOGIT_BIAS
from jaxserve.request.batch import GroupBatch, LateInputs

F32 = jnp.float32
NO_TOKEN = np.iinfo(np.int32).max  # a bias entry past any vocabulary: dropped
PENALTY_BUCKET = 64  # the fewest entries a row's penalties carry (then powers of two)


@jax.tree_util.register_dataclass
@dataclass
class SamplingArrays:
    temperature: jax.Array  # [b] f32; 0 means greedy
    top_k: jax.Array  # [b] int32; <= 0 means off
    top_p: jax.Array  # [b] f32 in (0, 1]
    min_p: jax.Array  # [b] f32 in [0, 1]; 0 means off
    seed: jax.Array  # [b] uint32
    position: jax.Array  # [b] int32, the position of the token being sampled (its key's second half)
    bias_ids: jax.Array  # [b, MAX_LOGIT_BIAS] int32: tokens whose logits get `bias` (NO_TOKEN: unused entry)
    bias: jax.Array  # [b, MAX_LOGIT_BIAS] f32
    allowed: jax.Array  # [b, mask_words(V)] int32: bit t % 32 of word t // 32 set = token t may be sampled

    @staticmethod
    def for_group(
        group: GroupBatch, bucket_rows: int, everything_allowed: jax.Array, masks: np.ndarray | None = None
    ) -> SamplingArrays:
        """Host arrays for a bucket of `bucket_rows` rows; rows past the group's are padding and sample greedily (their
        token is dropped). Each row samples the token at position start + length, its output token number
        start + length - prompt_len (its logit bias follows from that). `masks`: the group's late token masks
        (LateInputs.masks), padded here; without them the group takes `everything_allowed`, a mask kept on the
        device, so no mask is copied there."""
        params, pad = group.params, bucket_rows - group.num_rows
        bias_ids = np.full((bucket_rows, MAX_LOGIT_BIAS), NO_TOKEN, np.int32)
        bias = np.zeros((bucket_rows, MAX_LOGIT_BIAS), np.float32)
        for i, (p, number) in enumerate(zip(params, group.output_numbers)):
            entries = p.logit_bias_at(int(number))
            bias_ids[i, : len(entries)] = [token for token, _ in entries]
            bias[i, : len(entries)] = [value for _, value in entries]
        # Host numpy arrays: the jitted step takes them as its jax.Array inputs (hence Any).
        host: dict[str, Any] = dict(
            temperature=np.asarray([p.temperature for p in params] + [0.0] * pad, np.float32),
            top_k=np.asarray([p.top_k for p in params] + [-1] * pad, np.int32),
            top_p=np.asarray([p.top_p for p in params] + [1.0] * pad, np.float32),
            min_p=np.asarray([p.min_p for p in params] + [0.0] * pad, np.float32),
            seed=np.asarray([p.seed or 0 for p in params] + [0] * pad, np.uint32),
            position=np.asarray([*group.sample_positions, *[1] * pad], np.int32),
            bias_ids=bias_ids,
            bias=bias,
            allowed=everything_allowed if masks is None else _padded_masks(masks, bucket_rows),
        )
        return SamplingArrays(**host)

    def cuts(self) -> bool:
        """Whether some row has a top-k or top-p cut (host arrays, as `for_group` makes them): the batch must sort."""
        return bool(np.any(np.asarray(self.top_k) > 0) or np.any(np.asarray(self.top_p) < 1))


def _padded_masks(masks: np.ndarray, bucket_rows: int) -> np.ndarray:
    """A group's late token masks padded to its bucket (padding rows allow every token)."""
    padded = np.full((bucket_rows, masks.shape[1]), -1, np.int32)
    padded[: len(masks)] = masks
    return padded


@jax.tree_util.register_dataclass
@dataclass
class PenaltyArrays:
    """A group's penalties (vLLM's): per row the tokens they look at and how many times each came out, padded to a
    bucket of entries (NO_TOKEN: unused), and the three penalties (neutral for rows without them)."""

    token_ids: jax.Array  # [b, P] int32
    output_counts: jax.Array  # [b, P] f32; 0: the token is only in the prompt (repetition_penalty alone sees it)
    repetition: jax.Array  # [b] f32; 1 means off
    frequency: jax.Array  # [b] f32
    presence: jax.Array  # [b] f32

    @staticmethod
    def for_group(group: GroupBatch, late: LateInputs, bucket_rows: int) -> PenaltyArrays | None:
        """Host arrays, or None when no row has penalty entries (the group's logits go to the sampler untouched).
        The entries' bucket is a power of two (at least 64), so a group compiles once per bucket it reaches."""
        entries = {i: e for i, e in enumerate(late.penalty_entries) if e is not None}
        if not entries:
            return None
        width = max(PENALTY_BUCKET, 1 << (max(len(ids) for ids, _ in entries.values()) - 1).bit_length())
        arrays = PenaltyArrays.neutral(bucket_rows, width)
        for i, (ids, row_counts) in entries.items():
            arrays.token_ids[i, : len(ids)], arrays.output_counts[i, : len(ids)] = ids, row_counts
            p = group.params[i]
            arrays.repetition[i], arrays.frequency[i] = p.repetition_penalty, p.frequency_penalty
            arrays.presence[i] = p.presence_penalty
        return arrays

    @staticmethod
    def neutral(rows: int, width: int) -> PenaltyArrays:
        """Host arrays that penalize nothing (every entry unused, every penalty off), to fill in."""
        # Host numpy arrays: the jitted penalties take them as their jax.Array inputs (hence Any).
        token_ids: Any = np.full((rows, width), NO_TOKEN, np.int32)
        counts: Any = np.zeros((rows, width), np.float32)
        off: Any = np.zeros((3, rows), np.float32)
        off[0] = 1  # a repetition penalty of 1
        return PenaltyArrays(token_ids, counts, off[0], off[1], off[2])


def apply_penalties(logits: jax.Array, penalties: PenaltyArrays) -> jax.Array:
    """logits [b, V] with the penalties applied, in vLLM's order: repetition, then frequency and presence."""
    logits = logits.astype(F32)
    rows = jnp.arange(logits.shape[0])[:, None]
    counts = jnp.zeros_like(logits).at[rows, penalties.token_ids].add(penalties.output_counts, mode="drop")
    seen = jnp.zeros(logits.shape, bool).at[rows, penalties.token_ids].set(True, mode="drop")
    repetition = penalties.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - penalties.frequency[:, None] * counts - penalties.presence[:, None] * (counts > 0)


def _filter_row(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (to -inf) everything outside the top-k and outside the smallest top-p nucleus of one row."""
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits)[::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = sorted_logits[k - 1]
    probs = jax.nn.softmax(jnp.where(jnp.arange(vocab) < k, sorted_logits, -jnp.inf))
    before = jnp.cumsum(probs) - probs  # probability mass strictly ahead of each sorted token
    # top_p >= 1 is off: the cumulative sum's rounding must not drop the tail.
    last_kept = jnp.where(top_p < 1, jnp.maximum(jnp.sum(before < top_p) - 1, 0), k - 1)
    threshold = jnp.maximum(kth, sorted_logits[last_kept])
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def processed_logits(logits: jax.Array, params: SamplingArrays, cuts: bool = True) -> tuple[jax.Array, jax.Array]:
    """(each row's greedy token [b], its logits as the row samples from them [b, V]: biased, masked, scaled by its
    temperature, cut by its min-p, top-k and top-p, -inf outside); logits [b, V]. `cuts` False (static): no row has
    a top-k or top-p cut, and the vocabulary is not sorted."""
    logits = logits.astype(F32)
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, params.bias_ids].add(params.bias, mode="drop")
    vocab = jnp.arange(logits.shape[-1])
    allowed = (params.allowed[:, vocab // 32] >> (vocab % 32)) & 1
    logits = jnp.where(allowed.astype(bool), logits, -jnp.inf)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(params.temperature, 1e-6)[:, None]
    # min-p: a token whose probability is below min_p times the best one's is out (log 0 = -inf keeps them all). The
    # best scaled logit is the greedy token's (a positive divisor keeps the order): no second pass over the vocabulary.
    best = jnp.take_along_axis(scaled, greedy[:, None], axis=-1)
    scaled = jnp.where(scaled >= best + jnp.log(params.min_p)[:, None], scaled, -jnp.inf)
    return greedy, jax.vmap(_filter_row)(scaled, params.top_k, params.top_p) if cuts else scaled


def sampling_keys(params: SamplingArrays) -> jax.Array:
    """Each row's key: its (seed, position) pair's."""
    return jax.vmap(lambda seed, position: jax.random.fold_in(jax.random.key(seed), position))(
        params.seed, params.position
    )


def sample(logits: jax.Array, params: SamplingArrays, cuts: bool = True) -> jax.Array:
    """logits [b, V] float32 -> token ids [b] int32.

    Every row goes through every path (greedy, the top-k / top-p filter, the draw) and keeps its own: a branch on
    the batch's contents (`lax.cond`) would make a GPU copy its predicate to the host and wait, every step. Only the
    filter, which sorts the vocabulary of every row, is left out when the host, which holds the batch's parameters,
    knows that no row cuts (`cuts` False: a separately compiled sampler, `SamplingArrays.cuts`). A row that filters
    nothing comes out of the filter unchanged, and a greedy row keeps its argmax, so each row's token still does not
    depend on its batch."""
    greedy, filtered = processed_logits(logits, params, cuts)
    sampled = jax.vmap(jax.random.categorical)(sampling_keys(params), filtered).astype(jnp.int32)
    return jnp.where(params.temperature > 0, sampled, greedy)
