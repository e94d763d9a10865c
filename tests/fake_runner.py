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

from jaxserve.model.cache import CacheGeometry
from jaxserve.request import TokenLogprob
from jaxserve.request.step import MIXED_PREFILL_ROWS, RowOutput, StepKind, StepLimits, StepOutput, StepPlan
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
        self._answers: dict[str, list[int]] = {}

    def __call__(self, request, written: list[int]) -> int:
        if len(written) < request.prompt_len:  # a chunk short of the prompt's end: its token is not used
            return self.eos_id
        if len(written) == request.prompt_len:  # the prompt is complete: its first output token
            if not self.scripts:
                raise AssertionError("the test scripted no answer for this request")
            self.prompts.append(list(written))
            self._answers[request.request_id] = self.scripts.popleft()
        answer = self._answers[request.request_id]
        done = len(written) - request.prompt_len
        return answer[done] if done < len(answer) else self.eos_id


class FakeRunner:
    def __init__(
        self,
        geometry: CacheGeometry,
        buckets: Buckets,
        vocab: int,
        model: Callable[[object, list[int]], int] | None = None,
    ):
        self.geometry = geometry
        self.buckets = buckets
        self.vocab = vocab
        # (request, every token its slot holds) -> the next token; by default the rolling hash
        self.model = model or (lambda request, written: next_token(written, vocab))
        self.warmups = 0
        self.steps: list[StepPlan] = []
        self.fail = None  # a callable(plan) -> Exception | None, to inject failures
        self.lose_cache_on_failure = False
        self._limits = StepLimits(
            prefill_tokens=max(buckets.prefill_chunks),
            prefill_rows=max(buckets.prefill_rows),
            decode_rows=max(buckets.decode_rows),
            mixed_decode_rows=buckets.mixed_decode_group.rows if buckets.mixed else 0,
        )
        self.reset_cache()

    def warmup(self, shapes=None, show_progress: bool = False, stop=None) -> None:
        self.warmups += 1

    def limits(self) -> StepLimits:
        """Every bucket is "compiled"."""
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

    def run(self, plan: StepPlan) -> StepOutput:
        return self.dispatch(plan).result()

    def dispatch(self, plan: StepPlan) -> FakeStep:
        """Computes at once; a failure injected by `fail` surfaces when the result is waited for, as a device error
        would. Like the real runner, a decode row's input is the token its slot kept, at the row's position."""
        error = self.fail(plan) if self.fail is not None else None
        if error is not None:
            self._lost = self.lose_cache_on_failure
            self._undefined.update(r.slot for r in plan.requests)
            return FakeStep(error=error)
        slots = [r.slot for r in plan.requests]
        size = self.geometry.page_size
        written_pages = [
            p
            for row in plan.rows
            for p in row.request.pages[row.start // size : (row.start + row.length - 1) // size + 1]
        ]
        assert len(set(slots)) == len(slots), f"two rows share a slot: {slots}"
        assert len(set(written_pages)) == len(written_pages), "two rows write one KV page"
        limits = self._limits  # what is "compiled" now
        assert len(plan.prefill) <= limits.prefill_rows, "more prefill rows than the compiled shapes allow"
        assert all(row.length <= limits.prefill_tokens for row in plan.prefill), "a chunk longer than compiled"
        assert len(plan.decode) <= limits.decode_rows, "more decode rows than the compiled shapes allow"
        if plan.kind is StepKind.MIXED:
            assert limits.mixed, "a mixed step before mixed shapes compiled"
            assert len(plan.prefill) <= MIXED_PREFILL_ROWS, "a mixed step with more prompt chunks than it carries"
            assert plan.num_prefill_tokens + limits.mixed_decode_rows <= limits.prefill_tokens, (
                "a mixed step whose chunk and decode rows exceed a pure chunk's tokens"
            )
        out = []
        for row in plan.rows:
            request = row.request
            source = request.slot if row.read_row is None else row.read_row
            if row.start == 0 or source != request.slot:
                self._undefined.discard(request.slot)
            elif request.slot in self._undefined:
                out.append(RowOutput(0))
                continue
            written = [] if row.start == 0 else self._written[source]
            assert row.start == len(written), (
                f"{request.request_id}: writes at {row.start}, its state holds {len(written)}"
            )
            written = written + (row.token_ids or [self._kept[request.slot]])
            assert len(written) <= len(request.pages) * self.geometry.page_size, "positions beyond the row's pages"
            self._written[request.slot] = written
            if row.snapshot_row is not None:
                self._written[row.snapshot_row] = written[: row.start + row.snapshot_tokens]
            token = self.model(request, written)
            if row.samples_output:
                self._kept[request.slot] = token
            prompt = (
                None
                if request.sampling.prompt_logprobs is None or row.decode
                else [certain(t, request.sampling.prompt_logprobs) for t in row.prompt_logprob_targets]
            )
            out.append(RowOutput(token, certain(token, row.logprobs), prompt))
        self.steps.append(plan)
        split = len(plan.prefill)
        return FakeStep(StepOutput(tuple(out[:split]), tuple(out[split:])))


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
