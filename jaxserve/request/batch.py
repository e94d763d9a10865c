"""The step batch: one `StepPlan` as the runner takes it, in host arrays and frozen values (docs/architecture.md).

The engine turns each plan into a `StepBatch` before it dispatches the step: per group of rows, what the rows are
(tokens, positions, pages, slots, state rows, what they ask back) as read-only numpy arrays, one entry per row and no
padding (the runner pads them to the compiled shape it picks), and each row's frozen `SamplingParams`. The runner
never sees a request. What depends on the tokens before the step, a structured output's token mask and the
penalties' token counts, is asked through one hook, `GroupBatch.late`, when the runner launches the step's sampler:
by then the engine has delivered those tokens (overlap scheduling, jaxserve.runner.model_runner).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.config import ENGRAM_CONTEXT_TOKENS
from jaxserve.request.params import SamplingParams
from jaxserve.request.step import StepPlan, StepRow


@dataclass(frozen=True)
class LateInputs:
    """A group's sampling inputs that depend on the tokens before its step, one entry per row."""

    # [r, words] int32 bitmasks of the tokens each row may sample now (bit t % 32 of word t // 32); None: every row
    # may sample every token.
    masks: np.ndarray | None
    # Per row, (token ids, how many times each came out) for its penalties (jaxserve.request.record's
    # penalty_entries); None for a row without penalties or whose token is not an output token.
    penalty_entries: tuple[tuple[np.ndarray, np.ndarray] | None, ...]


@dataclass(frozen=True)
class GroupBatch:
    """One group of a step's rows (the prefill rows, or the decode rows), one entry per row."""

    decode: bool
    tokens: np.ndarray  # [r, c] int32: a prefill row's prompt tokens (c: the longest row); zeros for decode rows
    positions: np.ndarray  # [r] int32: the position of each row's first token
    lengths: np.ndarray  # [r] int32: a row's tokens (a verify row's: the most it may keep, drafts and the next one)
    slots: np.ndarray  # [r] int32: each row's sequence slot (a decode row's input token is the one kept there)
    page_table: np.ndarray  # [r, p] int32: each row's KV pages in order (p: the most any row holds; 0 past its own)
    page_counts: np.ndarray  # [r] int32: the pages each row holds
    read_rows: np.ndarray  # [r] int32: the state row a row's sequence state is read from (its slot, or a snapshot)
    snapshot_rows: np.ndarray  # [r] int32: the state row that also gets the state `snapshot_tokens` in (-1: none)
    snapshot_tokens: np.ndarray  # [r] int32
    keeps: np.ndarray  # [r] bool: the token sampled after the row is an output token (kept in its slot, returned)
    next_tokens: np.ndarray  # [r, c] int32: the prompt token after each position, for prompt logprobs and drafting
    # [r, ENGRAM_CONTEXT_TOKENS] int32: the tokens right before each row's first, oldest first (-1 before the sequence's
    # start): DeepSeek-V4.1's Engram hashes the n-grams that end in a row's tokens (a decode row's own token is on the
    # device, those before it are delivered)
    context: np.ndarray
    next_counts: np.ndarray  # [r] int32: the positions that have one (a prompt's last token has none)
    logprobs: np.ndarray  # [r] int32: alternatives returned with the sampled token (-1: no logprobs)
    prompt_logprobs: np.ndarray  # [r] int32: alternatives returned with each prompt token (-1: none asked)
    prompt_lens: np.ndarray  # [r] int32: with positions and lengths, the output token number each row samples
    params: tuple[SamplingParams, ...]
    late: Callable[[int], LateInputs]  # (mask words) -> the late inputs, asked once, when the sampler launches

    def __post_init__(self) -> None:
        for name in _ARRAYS:
            getattr(self, name).flags.writeable = False  # what the runner receives, it only reads

    @property
    def num_rows(self) -> int:
        return len(self.params)

    @property
    def longest(self) -> int:
        """The most tokens a row has (0 for a group of no rows)."""
        return int(self.lengths.max(initial=0))

    @property
    def sample_positions(self) -> np.ndarray:
        """The position of the token each row samples."""
        return self.positions + self.lengths

    @property
    def output_numbers(self) -> np.ndarray:
        """How many output tokens come before the one each row samples (negative after a chunk that is not its
        prompt's last: that token is dropped)."""
        return self.sample_positions - self.prompt_lens

    @staticmethod
    def of(rows: Sequence[StepRow], decode: bool) -> GroupBatch:
        n = len(rows)
        width = max((row.length for row in rows), default=1)
        pages = max((len(row.request.pages) for row in rows), default=0)
        tokens = np.zeros((n, width), np.int32)
        page_table = np.zeros((n, pages), np.int32)
        next_tokens = np.zeros((n, width), np.int32)
        context = np.array([row.request.tokens_before(row.start, ENGRAM_CONTEXT_TOKENS) for row in rows], np.int32)
        per_row = np.zeros(
            (n, len(_PER_ROW)), np.int32
        )  # one array, its columns the per-row fields (built once a step)
        for i, row in enumerate(rows):
            request = row.request
            if not decode:  # a decode row's token is on the device
                tokens[i, : row.length] = request.prompt_ids[row.start : row.start + row.length]
                following = request.prompt_ids[row.start + 1 : row.start + row.length + 1]
                next_tokens[i, : len(following)] = following
            page_table[i, : len(request.pages)] = request.pages
            slot = _slot(row)
            per_row[i] = (
                row.start,
                row.length,
                slot,
                len(request.pages),
                slot if row.read_row is None else row.read_row,
                -1 if row.snapshot_row is None else row.snapshot_row,
                row.snapshot_tokens,
                row.samples_output,
                0 if decode else len(following),
                -1 if row.logprobs is None else row.logprobs,
                _prompt_logprobs(row, decode),
                request.prompt_len,
            )
        columns = dict(zip(_PER_ROW, per_row.T))
        return GroupBatch(
            decode=decode,
            tokens=tokens,
            page_table=page_table,
            next_tokens=next_tokens,
            context=context.reshape(n, ENGRAM_CONTEXT_TOKENS),
            **{name: column.astype(bool) if name == "keeps" else column for name, column in columns.items()},
            params=tuple(row.request.sampling for row in rows),
            late=lambda words: _late_inputs(rows, words),
        )

    @staticmethod
    def padding(decode: bool) -> GroupBatch:
        """A group of no rows: the compiled shape it runs in is all padding (warm-up, abstract arguments)."""
        return GroupBatch.of((), decode)


_ARRAYS = tuple(f.name for f in dataclasses.fields(GroupBatch) if f.type == "np.ndarray")  # made read-only

# GroupBatch's one-entry-per-row fields, in the order GroupBatch.of fills them.
_PER_ROW = (
    "positions",
    "lengths",
    "slots",
    "page_counts",
    "read_rows",
    "snapshot_rows",
    "snapshot_tokens",
    "keeps",
    "next_counts",
    "logprobs",
    "prompt_logprobs",
    "prompt_lens",
)


def _slot(row: StepRow) -> int:
    if row.request.slot is None:
        raise ValueError(f"request {row.request.request_id!r} is in a step without a slot (it was never admitted)")
    return row.request.slot


def _prompt_logprobs(row: StepRow, decode: bool) -> int:
    asked = row.request.sampling.prompt_logprobs
    return -1 if decode or asked is None else asked


def _late_inputs(rows: Sequence[StepRow], words: int) -> LateInputs:
    masks = None
    for i, row in enumerate(rows):
        request = row.request
        if not row.samples_output or (request.grammar is None and request.sampling.allowed_token_ids is None):
            continue
        if masks is None:
            masks = np.full((len(rows), words), -1, np.int32)
        if request.grammar is not None:
            request.grammar.fill_mask(masks[i])
        if (allowed := request.sampling.allowed_token_ids) is not None:
            masks[i] &= token_bitmask(allowed, words)
    penalties = tuple(
        row.request.penalty_entries() if row.samples_output and row.request.sampling.penalized else None for row in rows
    )
    return LateInputs(masks, penalties)


def token_bitmask(token_ids: Sequence[int], words: int) -> np.ndarray:
    """The int32 bitmask (`words` long) in which exactly `token_ids` are set."""
    bits = np.zeros(words * 32, np.uint8)
    bits[np.asarray(token_ids, np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


@dataclass(frozen=True)
class StepBatch:
    """One step as the runner takes it: its prefill group, its decode group, or both (a mixed step)."""

    prefill: GroupBatch | None = None
    decode: GroupBatch | None = None

    def __post_init__(self) -> None:
        if self.prefill is None and self.decode is None:
            raise ValueError("a step batch has a prefill group, a decode group or both")

    @staticmethod
    def of(plan: StepPlan) -> StepBatch:
        return StepBatch(
            prefill=GroupBatch.of(plan.prefill, decode=False) if plan.prefill else None,
            decode=GroupBatch.of(plan.decode, decode=True) if plan.decode else None,
        )

    @property
    def groups(self) -> tuple[GroupBatch, ...]:
        """Every group, prefill first."""
        return tuple(group for group in (self.prefill, self.decode) if group is not None)

    @property
    def mixed(self) -> bool:
        return self.prefill is not None and self.decode is not None
