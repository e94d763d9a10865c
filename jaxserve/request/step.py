"""The step contract between the scheduler and the runner (docs/architecture.md).

The scheduler makes one `StepPlan` per step: rows, each naming its request, the token span it feeds and whether the
token sampled after it is an output token. The runner runs the plan in a compiled `StepShape` and hands back a
`StepOutput`, row by row; it reads requests and never changes one. `StepLimits` is what the compiled shapes allow
a plan to carry.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from jaxserve.request import Request, TokenLogprob

# A mixed step carries one prompt chunk beside its decode rows: a compiled step pads every prefill row to its longest
# chunk, so with two rows it would cost about twice the pure chunk it stands for, and the running requests' gap with it.
MIXED_PREFILL_ROWS = 1


class StepKind(enum.Enum):
    PREFILL = "prefill"  # prompt chunks only
    DECODE = "decode"  # one next token for each decoding request
    MIXED = "mixed"  # prompt chunks and decode rows in one step


@dataclass(frozen=True)
class StepRow:
    """`length` tokens of `request` at positions start, start + 1, ...

    A prefill row feeds its prompt's tokens [start, start + length); a decode row feeds one token, the last one
    sampled for its request, which the device kept in the request's slot (so its id is not on the host yet)."""

    request: Request
    start: int
    length: int
    decode: bool = False
    # The prefix cache's, for prefill rows: the state row (a snapshot) the sequence state is read from instead of
    # the request's slot (the first chunk after a hit), and the state row that also gets the state as of
    # `snapshot_tokens` tokens into this chunk (a page boundary the cache will share).
    read_row: int | None = None
    snapshot_row: int | None = None
    snapshot_tokens: int = 0

    @staticmethod
    def chunk(
        request: Request, start: int, length: int, read_row: int | None = None, snapshot: tuple[int, int] | None = None
    ) -> StepRow:
        """A prompt chunk; `snapshot`: (state row, tokens into the chunk)."""
        row, tokens = snapshot or (None, 0)
        return StepRow(request, start, length, read_row=read_row, snapshot_row=row, snapshot_tokens=tokens)

    @staticmethod
    def next_token(request: Request, draft_tokens: int = 0) -> StepRow:
        """The decode row of `request` after every token sampled for it so far. With `draft_tokens` (speculative
        decoding) a verify row: it may keep up to that many drafts and the token after them, as many as the
        request's max_tokens leaves room for (its length)."""
        room = request.sampling.max_tokens - request.num_sampled
        return StepRow(request, request.decode_position, max(1, min(draft_tokens + 1, room)), decode=True)

    @property
    def token_ids(self) -> list[int]:
        """The input tokens the host knows: a prefill row's prompt tokens; none for a decode row."""
        return [] if self.decode else self.request.prompt_ids[self.start : self.start + self.length]

    @property
    def samples_output(self) -> bool:
        """The token sampled after this row is an output token (a prompt's last chunk, every decode row): it is kept
        in the request's slot and its logprobs are returned if asked. After any other chunk it is dropped."""
        return self.decode or self.start + self.length == self.request.prompt_len

    @property
    def logprobs(self) -> int | None:
        """Alternatives to return with the sampled token (None: no logprobs for it)."""
        return self.request.sampling.logprobs if self.samples_output else None

    @property
    def prompt_logprob_targets(self) -> list[int]:
        """The prompt tokens whose logprobs this row returns: the one after each of its positions, for a prefill row
        of a request that asked (the token after the prompt's last is sampled, not a prompt token)."""
        if self.decode or self.request.sampling.prompt_logprobs is None:
            return []
        return self.request.prompt_ids[self.start + 1 : self.start + self.length + 1]


@dataclass(frozen=True)
class StepPlan:
    """One step: prefill rows (prompt chunks), decode rows, or both (a mixed step).

    `forced_by` names the step policy that put a decode-only step ahead of waiting prefill work (its registered name,
    "interleave", "stall": config.STEP_POLICIES); None when none did (prefill and mixed steps, and a decode taken
    because there was nothing to prefill)."""

    prefill: tuple[StepRow, ...] = ()
    decode: tuple[StepRow, ...] = ()
    forced_by: str | None = None

    def __post_init__(self) -> None:
        if not self.prefill and not self.decode:
            raise ValueError("a step carries prefill rows, decode rows or both")
        if any(row.decode for row in self.prefill) or not all(row.decode for row in self.decode):
            raise ValueError("prefill rows and decode rows are in the wrong groups")
        if self.forced_by is not None and self.prefill:
            raise ValueError("only a decode-only step is forced ahead of prefill")

    @staticmethod
    def decode_of(requests: list[Request] | tuple[Request, ...]) -> StepPlan:
        """A decode step advancing each of `requests` after every token sampled for it so far."""
        return StepPlan(decode=tuple(StepRow.next_token(request) for request in requests))

    @property
    def kind(self) -> StepKind:
        if self.prefill and self.decode:
            return StepKind.MIXED
        return StepKind.PREFILL if self.prefill else StepKind.DECODE

    @property
    def rows(self) -> tuple[StepRow, ...]:
        """Every row, prefill rows first, in row order."""
        return self.prefill + self.decode

    @property
    def num_prefill_tokens(self) -> int:
        return sum(row.length for row in self.prefill)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + sum(row.length for row in self.decode)

    @property
    def requests(self) -> list[Request]:
        """Every request the step advances, in row order."""
        return [row.request for row in self.rows]

    @property
    def completed(self) -> list[Request]:
        """Requests whose prompt this step completes, in row order."""
        return [row.request for row in self.prefill if row.samples_output]


@dataclass(frozen=True)
class RowOutput:
    """What a step returns for one row: the token sampled after it (dropped unless the row samples an output token),
    that token's logprobs and the row's prompt logprobs, each None unless the request asked."""

    token_id: int
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    # A verify row's (speculative decoding): the drafts it accepted, which come before `token_id`, of the `drafted`
    # it verified.
    accepted: tuple[int, ...] = ()
    drafted: int = 0

    NONE: ClassVar[RowOutput]  # a verify row that kept no token (its request had all it may have): never delivered

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token the row delivers, in order."""
        return self.accepted + (self.token_id,)


RowOutput.NONE = RowOutput(-1)


@dataclass(frozen=True)
class StepOutput:
    """A step's outputs, one per row of its plan, in the plan's order."""

    prefill: tuple[RowOutput, ...]
    decode: tuple[RowOutput, ...]


@dataclass(frozen=True, order=True)
class GroupShape:
    """The compiled shape of one group of rows: `rows` rows of `chunk` tokens each (a decode group: chunk 1)."""

    rows: int
    chunk: int

    def __str__(self) -> str:
        return f"rows={self.rows} chunk={self.chunk}"


@dataclass(frozen=True)
class StepShape:
    """One compiled step: a prefill group, a decode group, or both (a mixed step)."""

    prefill: GroupShape | None = None
    decode: GroupShape | None = None

    def __post_init__(self) -> None:
        if self.prefill is None and self.decode is None:
            raise ValueError("a step shape has a prefill group, a decode group or both")
        if self.decode is not None and self.decode.chunk != 1:
            raise ValueError(f"a decode group has one token per row, not {self.decode.chunk}")

    @property
    def kind(self) -> StepKind:
        if self.prefill is not None and self.decode is not None:
            return StepKind.MIXED
        return StepKind.PREFILL if self.prefill is not None else StepKind.DECODE

    @property
    def groups(self) -> tuple[tuple[GroupShape, bool], ...]:
        """(group shape, whether it is the decode group), prefill first."""
        return tuple(
            (group, decode) for group, decode in ((self.prefill, False), (self.decode, True)) if group is not None
        )

    @property
    def group_rows(self) -> tuple[int, ...]:
        """Each group's rows, prefill first: what the step's samplers are compiled for."""
        return tuple(group.rows for group, _ in self.groups)

    def __str__(self) -> str:
        return " + ".join(f"{'decode' if decode else 'prefill'} {group}" for group, decode in self.groups)

    @property
    def key(self) -> str:
        """A name without spaces, the same in every process (the process group's compile keys)."""
        return str(self).replace(" ", "")


@dataclass(frozen=True)
class StepLimits:
    """What the compiled shapes allow a step to carry (the scheduler keeps every plan within it).

    A mixed step's decode group always has `mixed_decode_rows` rows (padding the rest) and its prefill part one row
    (MIXED_PREFILL_ROWS) of at most `prefill_tokens - mixed_decode_tokens` tokens, so it costs what a pure chunk does
    (0: no mixed step compiled)."""

    prefill_tokens: int  # the longest chunk one row may have
    prefill_rows: int
    decode_rows: int
    mixed_decode_rows: int = 0
    decode_row_tokens: int = 1  # tokens a decode row carries: 1, or k + 1 where it verifies k drafts

    @property
    def mixed(self) -> bool:
        return self.mixed_decode_rows > 0

    @property
    def mixed_decode_tokens(self) -> int:
        """The tokens a mixed step's decode group takes of the step's."""
        return self.mixed_decode_rows * self.decode_row_tokens
