"""A StepRunner for engine and server tests that compiles nothing: its "model" is a rolling hash of everything
written to a sequence's slot, so the next token is hand-computable (`continuation`) and depends on every token
the engine fed, at the right positions, in the right slot.

Logprobs, for requests that ask, are those of a model certain of everything: 0.0 for the token sampled (or, for
prompt logprobs, for the prompt token shown), which is also the only entry of its top list.

It also checks what a real cache would silently get wrong: a chunk that does not continue its slot where the
last one ended, two rows of one step sharing a slot or writing one page, a row whose pages are too few for its
positions. The prefix cache's snapshots are state rows like the slots: a row that reads its state from one
continues what it holds, and a row that writes one leaves there what its slot holds that far into its chunk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.model.cache import CacheGeometry
from jaxserve.request import TokenLogprob
from jaxserve.request.batch import GroupBatch, StepBatch
from jaxserve.request.step import MIXED_PREFILL_ROWS, RowOutput, StepLimits, StepOutput
from jaxserve.runner import Buckets

HASH_MULTIPLIER = 1_000_003
HASH_MODULUS = 2**31 - 1


def next_token(history: list[int], vocab: int) -> int:
    """The fake model: the token after `history` (a whole sequence, prompt and output so far)."""
    h = 17
    for t in history:
        h = (h * HASH_MULTIPLIER + t + 1) % HASH_MODULUS
    return h % vocab


def continuation(prompt: list[int], n: int, vocab: int) -> list[int]:
    """The n tokens the fake model generates after `prompt`, on its own (what any batch must reproduce)."""
    history = list(prompt)
    for _ in range(n):
        history.append(next_token(history, vocab))
    return history[len(prompt) :]


class ScriptedModel:
    """A fake model that answers each new prompt with the next scripted token list, then EOS: for tests of the
    text layer (tool calls, reasoning) through the real engine. Records every prompt it was given."""

    def __init__(self, eos_id: int):
        self.eos_id = eos_id
        self.scripts: deque[list[int]] = deque()
        self.prompts: list[list[int]] = []
        self._answers: dict[int, list[int]] = {}  # by slot: the answer of the sequence there

    def __call__(self, slot: int, prompt_len: int, written: list[int]) -> int:
        if len(written) < prompt_len:  # a chunk short of the prompt's end: its token is not used
            return self.eos_id
        if len(written) == prompt_len:  # the prompt is complete: its first output token
            if not self.scripts:
                raise AssertionError("the test scripted no answer for this request")
            self.prompts.append(list(written))
            self._answers[slot] = self.scripts.popleft()
        answer = self._answers[slot]
        done = len(written) - prompt_len
        return answer[done] if done < len(answer) else self.eos_id


@dataclass(frozen=True)
class FakeParcel:
    """A handed-off sequence: every token its slot holds, the one sampled after them, the pages it was cut from."""

    sequence: tuple[int, ...]
    token: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class FakeRow:
    """One row of a step as the fake ran it: its sequence (the prompt its slot holds), where it wrote, whether its
    token was an output token."""

    prompt: tuple[int, ...]
    start: int
    length: int
    samples_output: bool


@dataclass(frozen=True)
class FakeStepRecord:
    prefill: tuple[FakeRow, ...]
    decode: tuple[FakeRow, ...]

    @property
    def mixed(self) -> bool:
        return bool(self.prefill and self.decode)


class FakeRunner:
    def __init__(
        self,
        geometry: CacheGeometry,
        buckets: Buckets,
        vocab: int,
        model: Callable[[int, int, list[int]], int] | None = None,
    ):
        self.geometry = geometry
        self.buckets = buckets
        self.vocab = vocab
        # (slot, prompt length, every token its slot holds) -> the next token; by default the rolling hash
        self.model = model or (lambda slot, prompt_len, written: next_token(written, vocab))
        self.warmups = 0
        self.steps: list[FakeStepRecord] = []
        self.fail = None  # a callable(batch) -> Exception | None, to inject failures
        self.installed: list[tuple[FakeParcel, tuple[int, ...], int]] = []  # arrivals: parcel, pages, slot
        self.lose_cache_on_failure = False
        self._limits = StepLimits(
            prefill_tokens=max(buckets.prefill_chunks),
            prefill_rows=max(buckets.prefill_rows),
            decode_rows=max(buckets.decode_rows),
            mixed_decode_rows=buckets.mixed_decode_group.rows if buckets.mixed else 0,
            decode_row_tokens=buckets.decode_row_tokens,
        )
        self.reset_cache()

    def warmup(self, shapes=None, show_progress: bool = False, stop=None) -> None:
        self.warmups += 1

    def limits(self) -> StepLimits:
        return self._limits

    def cache_lost(self) -> bool:
        return self._lost

    def reset_cache(self) -> None:
        self._written: dict[int, list[int]] = {}  # slot -> the tokens its sequence has written, in order
        self._kept: dict[int, int] = {}  # slot -> the token sampled for it last (the device's slot tokens)
        # Slots a failed step wrote: what they hold is undefined, as on a device, until a new sequence starts there.
        # A step dispatched behind the failed one may still have rows on them: they compute garbage, unchecked.
        self._undefined: set[int] = set()
        self._lost = False

    def run(self, batch: StepBatch) -> StepOutput:
        return self.dispatch(batch).result()

    def export_state(self, pages: list[int], slot: int) -> FakeParcel:
        """A slot's sequence as it stands (what a device parcel would carry), and the pages it was asked for."""
        return FakeParcel(tuple(self._written[slot]), self._kept[slot], tuple(pages))

    def install_state(self, parcel: FakeParcel, pages: list[int], slot: int, token: int) -> None:
        """The sequence arrives in `slot`; its pages must be as many as those sent (the rest were here already)."""
        assert len(pages) == len(parcel.pages), (pages, parcel.pages)
        self.installed.append((parcel, tuple(pages), slot))
        self._written[slot], self._kept[slot] = list(parcel.sequence), token
        self._undefined.discard(slot)

    def dispatch(self, batch: StepBatch) -> FakeStep:
        """Computes at once; a failure injected by `fail` surfaces when the result is waited for, as a device error
        would. Like the real runner, a decode row's input is the token its slot kept, at the row's position."""
        error = self.fail(batch) if self.fail is not None else None
        groups = batch.groups
        if error is not None:
            self._lost = self.lose_cache_on_failure
            self._undefined.update(int(slot) for group in groups for slot in group.slots)
            return FakeStep(error=error)
        slots = [int(slot) for group in groups for slot in group.slots]
        size = self.geometry.page_size
        written_pages = [
            int(p)
            for group in groups
            for start, length, pages in zip(group.positions, group.lengths, group.page_table)
            for p in pages[start // size : (start + length - 1) // size + 1]
        ]
        assert len(set(slots)) == len(slots), f"two rows share a slot: {slots}"
        assert len(set(written_pages)) == len(written_pages), "two rows write one KV page"
        limits = self._limits  # what is "compiled" now
        prefill, decode = batch.prefill, batch.decode
        if prefill is not None:
            assert prefill.num_rows <= limits.prefill_rows, "more prefill rows than the compiled shapes allow"
            assert prefill.longest <= limits.prefill_tokens, "a chunk longer than compiled"
        if decode is not None:
            assert decode.num_rows <= limits.decode_rows, "more decode rows than the compiled shapes allow"
        if prefill is not None and decode is not None:
            assert limits.mixed, "a mixed step before mixed shapes compiled"
            assert prefill.num_rows <= MIXED_PREFILL_ROWS, "a mixed step with more prompt chunks than it carries"
            assert int(prefill.lengths.sum()) + limits.mixed_decode_tokens <= limits.prefill_tokens, (
                "a mixed step whose chunk and decode rows exceed a pure chunk's tokens"
            )
        outputs = {group.decode: self._run_group(group) for group in groups}
        self.steps.append(
            FakeStepRecord(*(tuple(row for row, _ in outputs.get(decode, ())) for decode in (False, True)))
        )
        return FakeStep(StepOutput(*(tuple(out for _, out in outputs.get(decode, ())) for decode in (False, True))))

    def _run_group(self, group: GroupBatch) -> list[tuple[FakeRow, RowOutput]]:
        out = []
        for i in range(group.num_rows):
            slot, read_row = int(group.slots[i]), int(group.read_rows[i])
            start, length, keeps = int(group.positions[i]), int(group.lengths[i]), bool(group.keeps[i])
            prompt_len = int(group.prompt_lens[i])
            if start == 0 or read_row != slot:
                self._undefined.discard(slot)
            elif slot in self._undefined:
                out.append((FakeRow((), start, length, keeps), RowOutput(0)))
                continue
            written = [] if start == 0 else self._written[read_row]
            assert start == len(written), f"slot {slot}: writes at {start}, its state holds {len(written)}"
            fed = [self._kept[slot]] if group.decode else group.tokens[i, :length].tolist()
            written = written + fed
            assert len(written) <= int(group.page_counts[i]) * self.geometry.page_size, (
                "positions beyond the row's pages"
            )
            self._written[slot] = written
            if group.snapshot_rows[i] >= 0:
                self._written[int(group.snapshot_rows[i])] = written[: start + int(group.snapshot_tokens[i])]
            token = self.model(slot, prompt_len, written)
            if keeps:
                self._kept[slot] = token
            k = int(group.prompt_logprobs[i])
            targets = group.next_tokens[i, : int(group.next_counts[i])].tolist()
            prompt = None if k < 0 else [certain(t, k) for t in targets]
            logprobs = int(group.logprobs[i])
            row = FakeRow(tuple(written[:prompt_len]), start, length, keeps)
            out.append((row, RowOutput(token, certain(token, None if logprobs < 0 else logprobs), prompt)))
        return out


def certain(token: int, k: int | None) -> TokenLogprob | None:
    """The logprobs of a model sure of `token`; None when the request did not ask (k None)."""
    return None if k is None else TokenLogprob(int(token), 0.0, ((int(token), 0.0),)[:k])


class FakeStep:
    def __init__(self, result: StepOutput | None = None, error: Exception | None = None):
        self._result, self._error = result, error

    def sample(self) -> None:
        """The fake's tokens are fixed at dispatch: nothing to launch."""

    def result(self) -> StepOutput:
        if self._error is not None:
            raise self._error
        return self._result
