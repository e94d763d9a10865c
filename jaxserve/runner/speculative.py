"""Speculative decoding on the device (`--speculative-config '{"method": "mtp" | "dspark", "num_speculative_tokens":
k}'`).

One jitted step per decode batch drafts k tokens a row with the model's MTP block or its DSpark drafter, verifies them
with one forward of k + 1 tokens a row, accepts a prefix of them and samples one more, and takes back what the
rejected tokens wrote:
- drafts are the drafter's most likely tokens (as vLLM's MTP drafts); greedy rows accept a draft exactly when it
  is the model's argmax; sampled rows by rejection sampling with the draft as a point mass q (draft d is kept with
  probability p(d), and at the first rejection the token comes from max(p - q, 0) renormalised: p without d), so
  every token follows the model's own distribution p, the one the plain sampler draws from (temperature, min-p,
  top-k, top-p);
- the verify forward also writes each row's sequence state (window ring, compressor state) as of 1..k of its tokens
  into the slot's draft rows (`CacheGeometry.draft_row`); a row that accepts fewer tokens than it ran gets the
  state of the tokens it kept copied back into its slot. KV pages are reserved at admission for the request's
  whole length, so no draft takes or leaves one, and the compressed entries of windows a rejected token completed
  are invisible to every later query (masked by position) until the real tokens complete those windows and
  rewrite them;
- where a row is, its slot's last sampled position, is device state (`SpeculativeCache.positions`) that the step
  advances by the tokens it kept: the host dispatches the next step before it has seen them (overlap scheduling),
  so a verify group's host inputs (`VerifyInputs`) name slots, not positions, and the step bounds the tokens a row
  may keep by its request's max_tokens (the host's count of them lags by the step in flight).

The MTP block reads the main model's last hc streams at position i and the token at i + 1. Each slot keeps the
streams of its last kept position (`DraftState.streams`), whose next token (the one sampled last) is in the slot's
token; a step first runs the block there (its draft 1), then on its own output for drafts 2..k (on a copy of its
ring, so nothing a draft writes stays), and after verifying, over the positions whose next token it kept. Prefill
runs the block over each chunk (`prefill_drafts`), so its ring holds the prompt when decoding starts.

DSpark (jaxserve.model.dspark) drafts all k in one block from the slot's last sampled token, reading each stage's
ring of context keys (`DSparkState`); the verify forward also taps the target's hidden states, and the positions the
row kept (its last sampled token and the accepted drafts) write their keys into the rings, as prefill's chunks do:
nothing a rejected draft did is ever stored. The rings are per-sequence state like the target's window ring, so
prefix-cache snapshots and hits carry them too.

Letters: b rows, t tokens of a row, k drafts, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.kernels.table import Kernels
from jaxserve.model.cache import CacheGeometry, LayerCache, abstract_cache, abstract_dspark_cache, abstract_mtp_cache
from jaxserve.model.dspark import draft_block, write_context
from jaxserve.model.forward import final_norm, mtp_block, tapped_streams, vocab_logits
from jaxserve.model.inputs import StepInputs
from jaxserve.model.weights import ArrayInfo, Weights
from jaxserve.runner.sampling import SamplingArrays, processed_logits, sampling_keys

F32 = jnp.float32
# What each random draw of a step folds into its row's (seed, position) key, so the two never share one.
ACCEPT_SALT, BONUS_SALT = 2, 3


@jax.tree_util.register_dataclass
@dataclass
class DraftState:
    """What drafting keeps per slot between steps: the MTP block's sliding-window ring, and the main model's last hc
    streams at the slot's last kept position ([state rows, n, d])."""

    mtp_cache: LayerCache
    streams: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class DSparkState:
    """What DSpark drafting keeps per slot between steps: each stage's window ring of context keys (jaxserve.model.
    dspark), stacked [S, state rows, W, k]. Written only at positions the target kept, so nothing is taken back."""

    rings: LayerCache


@jax.tree_util.register_dataclass
@dataclass
class DraftInputs:
    """A prefill group's input to the MTP block: each position's next prompt token [b, t], and how many positions
    have one [b] (all of a chunk but the prompt's last token, whose next token is the one sampled after it)."""

    next_tokens: jax.Array
    lengths: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class VerifyInputs:
    """A verify group's host inputs, one row per decoding request (padding rows: last position 0, so they keep
    nothing). Its positions and how many tokens each row may keep are not here: the device resolves them from the
    slots' positions (`SpeculativeCache.positions`, `_resolved`)."""

    slots: jax.Array  # [b]
    page_table: jax.Array  # [b, max_pages_per_seq]
    last_positions: jax.Array  # [b]: the position of the request's last output token (its max_tokens-th)
    draft_rows: jax.Array  # [b, k]: the state rows that get the slot's state as of 1..k tokens into the step


@jax.tree_util.register_dataclass
@dataclass
class Verified:
    """A verify step's tokens: per row the accepted drafts then one sampled token [b, k + 1] (-1 past them), how
    many there are [b] (0 for padding rows), and how many drafts the row verified [b] (fewer than k near its
    max_tokens)."""

    tokens: jax.Array
    counts: jax.Array
    verified: jax.Array


def _keyed(params: SamplingArrays, salt: int) -> jax.Array:
    return jax.vmap(lambda key: jax.random.fold_in(key, salt))(sampling_keys(params))


def _at_positions(params: SamplingArrays, positions: jax.Array) -> SamplingArrays:
    """Each row's sampling parameters for the token at `positions [b, j]`, as b * j rows."""
    j = positions.shape[1]
    repeated = jax.tree.map(lambda a: jnp.repeat(a, j, axis=0), params)
    return dataclasses.replace(repeated, position=positions.reshape(-1))


def _draw(filtered: jax.Array, greedy: jax.Array, params: SamplingArrays, salt: int) -> jax.Array:
    sampled = jax.vmap(jax.random.categorical)(_keyed(params, salt), filtered).astype(jnp.int32)
    return jnp.where(params.temperature > 0, sampled, greedy)


def prefill_drafts(
    weights: Weights,
    draft: DraftState | DSparkState,
    streams: jax.Array,
    taps: jax.Array | None,
    inputs: StepInputs,
    draft_inputs: DraftInputs,
    completes: jax.Array,
    cfg: ModelConfig,
    kernels: Kernels,
) -> DraftState | DSparkState:
    """The drafter's state after a prefill group's chunk (the target's last streams [b, t, n, d], and its taps for
    DSpark): DSpark's rings get the chunk's context keys; the MTP block runs over the chunk, and a row that
    `completes [b]` its prompt leaves the streams of its last token in its slot, for the first step's draft."""
    if isinstance(draft, DSparkState):
        assert weights.dspark is not None and taps is not None  # DSpark drafting holds its weights and taps
        return DSparkState(write_context(weights.dspark, draft.rings, taps, inputs, cfg, kernels))
    mtp_inputs = dataclasses.replace(
        inputs,
        tokens=draft_inputs.next_tokens,
        lengths=draft_inputs.lengths,
        read_rows=None,
        snapshot_rows=None,
        snapshot_lengths=None,
    )
    _, _, mtp_cache = mtp_block(weights.mtp[0], weights.embed, streams, draft.mtp_cache, mtp_inputs, cfg, kernels)
    last = jnp.clip(inputs.lengths - 1, 0, None)
    final = jnp.take_along_axis(streams, last[:, None, None, None], axis=1)[:, 0]
    keep = jnp.where(completes, inputs.slots, draft.streams.shape[0])
    return DraftState(mtp_cache, draft.streams.at[keep].set(final.astype(draft.streams.dtype), mode="drop"))


def _propose(
    weights: Weights,
    draft: DraftState,
    last: jax.Array,
    inputs: StepInputs,
    k: int,
    cfg: ModelConfig,
    kernels: Kernels,
) -> tuple[jax.Array, LayerCache]:
    """k drafts per row [b, k], each the MTP block's most likely token (as vLLM's MTP drafts), and the MTP ring with
    the slot's pending position written."""
    active = (inputs.lengths > 0).astype(jnp.int32)
    one = StepInputs(
        tokens=last[:, None],
        positions=inputs.positions - 1,
        lengths=active,
        slots=inputs.slots,
        page_table=inputs.page_table,
    )
    pending = draft.streams[inputs.slots][:, None]
    h, y, mtp_cache = mtp_block(weights.mtp[0], weights.embed, pending, draft.mtp_cache, one, cfg, kernels)

    def most_likely(y: jax.Array) -> jax.Array:
        return jnp.argmax(vocab_logits(y[:, 0], weights.head, cfg.vocab_size), axis=-1).astype(jnp.int32)

    first = most_likely(y)
    if k == 1:
        return first[:, None], mtp_cache
    # Drafts 2..k: the block on its own output, on a copy of the rows' rings (what they write is never kept), as one
    # scanned body whatever k is.
    rows = jnp.arange(last.shape[0], dtype=jnp.int32)
    local = jax.tree.map(lambda a: a[:, inputs.slots], mtp_cache)

    def next_draft(carry, j):
        h, local, token = carry
        step = dataclasses.replace(one, tokens=token[:, None], positions=inputs.positions - 1 + j, slots=rows)
        h, y, local = mtp_block(weights.mtp[0], weights.embed, h, local, step, cfg, kernels)
        token = most_likely(y)
        return (h, local, token), token

    _, rest = jax.lax.scan(next_draft, (h, local, first), jnp.arange(1, k, dtype=jnp.int32))
    return jnp.concatenate([first[:, None], rest.T], axis=1), mtp_cache


def _accept(
    drafts: jax.Array, logits: jax.Array, inputs: StepInputs, params: SamplingArrays, sampled: bool = True
) -> Verified:
    """The tokens each row keeps: its longest run of accepted drafts among the first `lengths - 1`, then a token
    sampled where the run ends. A draft is one token, not a distribution (a point mass q): a sampled row keeps draft
    d with probability p(d), and after a rejection samples from p without d, renormalised (max(p - q, 0)); after its
    last draft, from p. So each token follows p, the distribution the plain sampler draws from. Not `sampled`: every
    row is greedy (the host knows), and only the argmax of each position is computed."""
    b, k = drafts.shape
    if not sampled:
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [b, k + 1]
        ok = (drafts == greedy[:, :k]) & (jnp.arange(k)[None, :] < inputs.lengths[:, None] - 1)
        accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
        return _verified(drafts, accepted, jnp.take_along_axis(greedy, accepted[:, None], axis=1)[:, 0], inputs)
    positions = inputs.positions[:, None] + 1 + jnp.arange(k + 1)[None, :]
    at = _at_positions(params, positions)
    greedy, filtered = processed_logits(logits.reshape(b * (k + 1), -1), at)
    greedy, filtered = greedy.reshape(b, k + 1), filtered.reshape(b, k + 1, -1)
    p = jax.nn.softmax(filtered, axis=-1)
    p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    uniform = jax.vmap(jax.random.uniform)(_keyed(_at_positions(params, positions[:, :k]), ACCEPT_SALT))
    sampled_ok = uniform.reshape(b, k) < p_draft
    greedy_row = (params.temperature <= 0)[:, None]
    ok = jnp.where(greedy_row, drafts == greedy[:, :k], sampled_ok)
    ok = ok & (jnp.arange(k)[None, :] < inputs.lengths[:, None] - 1)  # only drafts the row has room for
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [b]
    # Where the run ends: p without the rejected draft after a rejection, p itself after the last draft it ran.
    p_end = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    rejected = accepted < inputs.lengths - 1
    rejected_draft = jnp.take_along_axis(jnp.pad(drafts, ((0, 0), (0, 1))), accepted[:, None], axis=1)
    residual = jnp.where(rejected[:, None] & (jnp.arange(p.shape[-1])[None, :] == rejected_draft), 0.0, p_end)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_end)  # rounding: p(d) == 1
    end = dataclasses.replace(params, position=inputs.positions + 1 + accepted)
    bonus = _draw(jnp.log(residual), jnp.take_along_axis(greedy, accepted[:, None], axis=1)[:, 0], end, BONUS_SALT)
    return _verified(drafts, accepted, bonus, inputs)


def _verified(drafts: jax.Array, accepted: jax.Array, bonus: jax.Array, inputs: StepInputs) -> Verified:
    """Each row's first `accepted` drafts, then `bonus`."""
    index = jnp.arange(drafts.shape[1] + 1)[None, :]
    padded = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(index < accepted[:, None], padded, jnp.where(index == accepted[:, None], bonus[:, None], -1))
    counts = jnp.where(inputs.lengths > 0, accepted + 1, 0)
    verified = jnp.clip(inputs.lengths - 1, 0, None)
    return Verified(tokens.astype(jnp.int32), counts.astype(jnp.int32), verified.astype(jnp.int32))


def _take_back(cache: list[list[LayerCache]], inputs: StepInputs, kept: jax.Array) -> list[list[LayerCache]]:
    """Each row that kept fewer tokens than it ran gets its state as of the tokens it kept from its draft row."""
    assert inputs.snapshot_rows is not None  # a verify group writes one draft row per draft
    partial = (kept > 0) & (kept < inputs.lengths)
    source = jnp.take_along_axis(inputs.snapshot_rows, jnp.clip(kept - 1, 0, None)[:, None], axis=1)[:, 0]

    def restore(store):
        def one(a):
            target = jnp.where(partial, inputs.slots, a.shape[1])  # past every state row: dropped
            return a.at[:, target].set(a[:, source], mode="drop")

        return jax.tree.map(one, store)

    return [
        [
            dataclasses.replace(
                layer,
                window=restore(layer.window),
                state=None if layer.state is None else restore(layer.state),
                index_state=None if layer.index_state is None else restore(layer.index_state),
            )
            for layer in segment
        ]
        for segment in cache
    ]


def _resolved(verify: VerifyInputs, slot_positions: jax.Array, state_rows: int) -> StepInputs:
    """A verify group's StepInputs (its tokens zeros until the drafts are made): each row at its slot's position,
    keeping its k drafts and the token after them, or as many as its max_tokens leaves (none once it has them all: a
    request the host ends on an earlier step's tokens), and writing the draft rows of the tokens it may keep past its
    first."""
    k = verify.draft_rows.shape[1]
    positions = slot_positions[verify.slots]
    lengths = jnp.clip(jnp.minimum(k + 1, verify.last_positions - positions), 0, None)
    tokens_in = jnp.arange(1, k + 1, dtype=jnp.int32)[None, :]
    writes = tokens_in < lengths[:, None]
    return StepInputs(
        tokens=jnp.zeros((verify.slots.shape[0], k + 1), jnp.int32),
        positions=positions,
        lengths=lengths.astype(jnp.int32),
        slots=verify.slots,
        page_table=verify.page_table,
        read_rows=verify.slots,
        snapshot_rows=jnp.where(writes, verify.draft_rows, state_rows),
        snapshot_lengths=jnp.where(writes, tokens_in, 0),
    )


def decoding_from(slot_positions: jax.Array, inputs: StepInputs, completes: jax.Array) -> jax.Array:
    """The slots' positions after a prefill group: a row that `completes [b]` its prompt leaves its slot at the
    position of the token sampled after it, where its first verify step starts."""
    target = jnp.where(completes, inputs.slots, slot_positions.shape[0])
    return slot_positions.at[target].set(inputs.positions + inputs.lengths, mode="drop")


def speculative_step(
    weights: Weights,
    state: SpeculativeCache,
    slot_tokens: jax.Array,
    verify: VerifyInputs,
    params: SamplingArrays,
    geometry: CacheGeometry,
    cfg: ModelConfig,
    kernels: Kernels,
    sampled: bool = True,
    prompts: Sequence[StepInputs] = (),
):
    """One decode step with k = geometry.draft_tokens drafts per row (`sampled` False: every row is greedy, see
    _accept) over the runner's device state. `prompts`: prompt chunks that ride in the same target forward (a mixed
    step); the caller runs their drafter and sampler from the last streams and taps returned for them. Returns
    (Verified, the prompts' streams, their taps (None without DSpark), state, slot tokens)."""
    k, draft = geometry.draft_tokens, state.draft
    inputs = _resolved(verify, state.positions, geometry.state_rows)
    last = slot_tokens[inputs.slots]
    dspark = isinstance(draft, DSparkState)
    if isinstance(draft, DSparkState):
        assert weights.dspark is not None  # DSpark drafting holds its weights
        drafts = draft_block(weights.dspark, weights.embed, weights.head, draft.rings, last, inputs, k, cfg, kernels)
    else:
        drafts, mtp_cache = _propose(weights, draft, last, inputs, k, cfg, kernels)
        draft = DraftState(mtp_cache, draft.streams)
    with jax.named_scope("verify"):
        fed = dataclasses.replace(inputs, tokens=jnp.concatenate([last[:, None], drafts], axis=1))
        streams, cache, taps, _ = tapped_streams(weights, state.kv, [*prompts, fed], cfg, kernels, tap=dspark)
        head = (weights.hc_head_fn, weights.hc_head_base, weights.hc_head_scale, weights.norm)
        y = final_norm(streams[-1], *head, cfg, kernels)
        logits = vocab_logits(y, weights.head, cfg.vocab_size)
    verified = _accept(drafts, logits, inputs, params, sampled)
    accepted = jnp.maximum(verified.counts - 1, 0)
    cache = _take_back(cache, inputs, verified.counts)
    if isinstance(draft, DSparkState):
        with jax.named_scope("dspark_context"):  # the kept tokens' context keys: the row's last token and its drafts
            assert weights.dspark is not None and taps is not None
            kept = StepInputs(
                tokens=fed.tokens,
                positions=inputs.positions,
                lengths=verified.counts,
                slots=inputs.slots,
                page_table=inputs.page_table,
            )
            draft = DSparkState(write_context(weights.dspark, draft.rings, taps[-1], kept, cfg, kernels))
    else:
        draft = _mtp_catch_up(weights, draft, streams[-1], drafts, accepted, inputs, cfg, kernels)
    active = jnp.where(inputs.lengths > 0, inputs.slots, slot_tokens.shape[0])  # padding and finished rows: dropped
    bonus = jnp.take_along_axis(verified.tokens, accepted[:, None], axis=1)[:, 0]
    slot_tokens = slot_tokens.at[active].set(bonus, mode="drop")
    positions = state.positions.at[active].set(inputs.positions + verified.counts, mode="drop")
    prompt_taps = None if taps is None else taps[:-1]
    return verified, streams[:-1], prompt_taps, SpeculativeCache(cache, draft, positions), slot_tokens


def _mtp_catch_up(
    weights: Weights,
    draft: DraftState,
    streams: jax.Array,
    drafts: jax.Array,
    accepted: jax.Array,
    inputs: StepInputs,
    cfg: ModelConfig,
    kernels: Kernels,
) -> DraftState:
    """The MTP block over the kept positions whose next token is a kept draft, and each row's streams at its last
    kept position."""
    with jax.named_scope("mtp_catch_up"):
        kept = StepInputs(
            tokens=drafts,
            positions=inputs.positions,
            lengths=accepted,
            slots=inputs.slots,
            page_table=inputs.page_table,
        )
        k = drafts.shape[1]
        _, _, mtp_cache = mtp_block(weights.mtp[0], weights.embed, streams[:, :k], draft.mtp_cache, kept, cfg, kernels)
    rows = draft.streams.shape[0]
    target = jnp.where(inputs.lengths > 0, inputs.slots, rows)
    final = jnp.take_along_axis(streams, accepted[:, None, None, None], axis=1)[:, 0]
    return DraftState(mtp_cache, draft.streams.at[target].set(final.astype(draft.streams.dtype), mode="drop"))


@jax.tree_util.register_dataclass
@dataclass
class SpeculativeCache:
    """The runner's device state with drafting on, donated together: the KV cache, the draft state, and each slot's
    position [slots] (of the last token sampled for it: the one its next verify step feeds first)."""

    kv: list[list[LayerCache]]
    draft: DraftState | DSparkState
    positions: jax.Array


def abstract_runner_cache(cfg: ModelConfig, geo: CacheGeometry) -> list[list[LayerCache]] | SpeculativeCache:
    """What a runner keeps on the devices between steps, described (ArrayInfo leaves): the KV cache, and with drafts
    (`geo.draft_tokens`) the draft state beside it."""
    if not geo.draft_tokens:
        return abstract_cache(cfg, geo)
    # ArrayInfo leaves where the live state holds arrays.
    positions: Any = ArrayInfo((geo.num_slots,), jnp.int32, ("slots",), "zeros")
    if cfg.dspark_drafting:
        return SpeculativeCache(abstract_cache(cfg, geo), DSparkState(abstract_dspark_cache(cfg, geo)), positions)
    (ring,) = abstract_mtp_cache(cfg, geo)
    streams: Any = ArrayInfo((geo.num_slots, cfg.hc_mult, cfg.hidden_size), cfg.dtype, ("slots", None, None), "zeros")
    return SpeculativeCache(abstract_cache(cfg, geo), DraftState(ring, streams), positions)
