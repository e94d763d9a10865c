"""A step's device inputs, built on the host from its StepBatch: each group's rows padded to the compiled shape they
run in. The same builders make the real inputs and, applied to a shape's padding groups, the abstract ones its
executables are compiled for (jaxserve.runner.executables): there is no second description of a step's arguments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxserve.model.cache import CacheGeometry
from jaxserve.model.inputs import StepInputs
from jaxserve.request.batch import GroupBatch
from jaxserve.request.step import GroupShape, StepShape
from jaxserve.runner.logprobs import LogprobInputs
from jaxserve.runner.speculative import DraftInputs, VerifyInputs


@jax.tree_util.register_dataclass
@dataclass
class TokenRoutes:
    """Where each row's tokens come from and where its sampled token goes, on the device."""

    feed_from_slot: jax.Array  # [b] bool: the row's input is the token its slot sampled last (decode rows)
    store_slot: jax.Array  # [b] int32: the slot that keeps the sampled token; num_slots: not kept (dropped)


@jax.tree_util.register_dataclass
@dataclass
class GroupInputs:
    """One group's device inputs, padded to its compiled shape: what its rows are (`step`), where their tokens come
    from and go (`routes`), what logprobs they ask for (`asked`), and a prefill group's drafting inputs with
    speculative decoding on (None otherwise)."""

    step: StepInputs
    routes: TokenRoutes
    asked: LogprobInputs
    drafting: DraftInputs | None = None


@dataclass(frozen=True)
class StepGroup:
    """One group of a step's rows and the compiled shape they run in."""

    rows: GroupBatch
    shape: GroupShape

    @property
    def decode(self) -> bool:
        return self.rows.decode


def padding_groups(shape: StepShape) -> list[StepGroup]:
    """`shape`'s groups with no rows: every row padding (warm-up, abstract arguments)."""
    return [StepGroup(GroupBatch.padding(decode), group) for group, decode in shape.groups]


def group_inputs(group: StepGroup, geometry: CacheGeometry) -> GroupInputs:
    """A group's device inputs, padded to its compiled shape (host arrays)."""
    rows, bucket_rows, chunk = group.rows, group.shape.rows, group.shape.chunk
    pad = _padder(bucket_rows)
    prefix_state = {}
    if not group.decode:  # where each row's sequence state comes from, and which snapshot it also writes (none: past
        # every state row, so the write is dropped)
        snapshot_rows = np.where(rows.snapshot_rows < 0, geometry.state_rows, rows.snapshot_rows)
        prefix_state = dict(
            read_rows=pad(rows.read_rows),
            snapshot_rows=pad(snapshot_rows[:, None], fill=geometry.state_rows),
            snapshot_lengths=pad(rows.snapshot_tokens[:, None]),
        )
    inputs = StepInputs(
        tokens=pad(rows.tokens, chunk),
        positions=pad(rows.positions),
        lengths=pad(rows.lengths),
        slots=pad(rows.slots),
        page_table=_page_table(rows, pad, geometry),
        context=pad(rows.context, fill=-1),
        **prefix_state,
    )
    # Padding rows keep nothing: their store slot is past every slot.
    store = pad(np.where(rows.keeps, rows.slots, geometry.num_slots), fill=geometry.num_slots)
    feed_from_slot: Any = np.full(bucket_rows, group.decode)
    routes = TokenRoutes(feed_from_slot=feed_from_slot, store_slot=store)
    asked = LogprobInputs(sampled=pad(rows.logprobs >= 0))
    if chunk > 1:  # a prefill group: its prompt logprobs are the token after each position's
        wants = (rows.prompt_logprobs >= 0) & (rows.next_counts > 0)
        asked = LogprobInputs(sampled=asked.sampled, prompt=pad(wants), targets=pad(rows.next_tokens, chunk))
    drafting = None
    if geometry.draft_tokens and not group.decode:  # each position's next prompt token, for the MTP block
        drafting = DraftInputs(pad(rows.next_tokens, chunk), pad(rows.next_counts))
    return GroupInputs(inputs, routes, asked, drafting)


def verify_inputs(group: StepGroup, geometry: CacheGeometry) -> VerifyInputs:
    """A verify group's host inputs: each row's slot and pages, its request's last output position, and its slot's
    draft rows (the device resolves the rest, jaxserve.runner.speculative)."""
    rows, k = group.rows, geometry.draft_tokens
    pad = _padder(group.shape.rows)
    draft_rows = np.array([[geometry.draft_row(int(s), j) for j in range(1, k + 1)] for s in rows.slots], np.int32)
    max_tokens = np.array([params.max_tokens for params in rows.params], np.int32)
    return VerifyInputs(
        slots=pad(rows.slots),
        page_table=_page_table(rows, pad, geometry),
        last_positions=pad(rows.prompt_lens + max_tokens - 1),
        draft_rows=pad(draft_rows.reshape(rows.num_rows, k), fill=geometry.state_rows),
    )


def _page_table(rows: GroupBatch, pad: Callable[..., Any], geometry: CacheGeometry) -> Any:
    max_pages = geometry.max_pages_per_seq
    if rows.page_counts.max(initial=0) > max_pages:
        i = int(np.argmax(rows.page_counts))
        raise ValueError(f"row {i} has {rows.page_counts[i]} pages; a page table holds {max_pages}")
    return pad(rows.page_table, max_pages)


def _padder(bucket_rows: int) -> Callable[..., Any]:
    """pad(array, columns=None, fill=0): `array`'s rows (and columns, if given) grown to the bucket's with `fill`.
    Host numpy arrays: the jitted step takes them as its jax.Array inputs (hence Any)."""

    def pad(array: np.ndarray, columns: int | None = None, fill: int = 0) -> Any:
        shape = (bucket_rows, *(array.shape[1:] if columns is None else (columns,)))
        if array.shape == shape:  # nothing to pad: the batch's own (read-only) array
            return array
        padded = np.full(shape, fill, array.dtype)
        padded[tuple(slice(0, size) for size in array.shape)] = array
        return padded

    return pad
