"""The engine loop: on its own thread, schedule -> run -> deliver sampled tokens -> finish and free.

Public API: `submit()` (returns a RequestHandle whose token events can be awaited from asyncio or waited for
from a thread), `abort(request_id)`, `stats()`, `step_record`, `start()` / `shutdown()`, `drain()` /
`is_draining` / `is_running`. Requests and aborts reach the loop through an inbox and take effect at the next
step boundary; all scheduler state is touched by the loop thread only.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
import zlib
from collections import deque
from collections.abc import AsyncGenerator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from jaxserve.config import ConfigError, EngineConfig, ModelConfig
from jaxserve.engine.handoff import Arrival, PrefillAsk, StateSource
from jaxserve.model.cache import CacheGeometry, resolve_max_model_len
from jaxserve.paging import pages_needed
from jaxserve.request import (
    FinishReason,
    InvalidRequest,
    Request,
    RequestStatus,
    SamplingParams,
    TokenLogprob,
    listed,
)
from jaxserve.request.batch import StepBatch
from jaxserve.request.grammar import GrammarCompiler
from jaxserve.request.step import GroupShape, RowOutput, StepKind, StepLimits, StepOutput, StepPlan
from jaxserve.runner import Buckets
from jaxserve.runner.transfer import Parcel
from jaxserve.scheduler import IdAllocator, PrefixCache, PrefixStats, StepCounts, build_scheduler

log = logging.getLogger("jaxserve.engine")


class QueueFull(RuntimeError):
    """submit() refused a request: `max_queued_requests` requests are already waiting for admission."""


class EngineDraining(RuntimeError):
    """submit() refused a request: the engine is draining for shutdown and admits nothing new."""


@dataclass(frozen=True)
class TokenEvent:
    """What one step produced for one request: new token ids, and whether (and why) it finished.

    With `sampling.logprobs`, `logprobs` has one entry per token id; with `sampling.prompt_logprobs`, the request's
    first event carries `prompt_logprobs`, one entry for each prompt token after the first."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache had (not prefilled); on every event
    parcel: Parcel | None = None  # a handed-off request's state (on its last event; a prefill server's)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Finished(NamedTuple):
    """A finished request, as RequestHandle.wait() returns it."""

    token_ids: list[int]
    finish_reason: FinishReason
    error: str | None


@dataclass(frozen=True)
class _Submit:
    """Into the engine's inbox: schedule this request."""

    request: Request


@dataclass(frozen=True)
class _Abort:
    """Into the engine's inbox: finish this request (if still live) with `reason`."""

    request_id: str
    reason: FinishReason
    stop_reason: int | str | None


@dataclass(frozen=True)
class _Arrived:
    """Into the engine's inbox: a remote request's state arrived for what it was asked (or why it cannot)."""

    request: Request
    ask: PrefillAsk
    arrival: Arrival | Exception


@dataclass(frozen=True)
class _Live:
    """A submitted, unfinished request and the caller's handle to it."""

    request: Request
    handle: RequestHandle


class RequestHandle:
    """The caller's side of a request: a stream of TokenEvents, usable from asyncio or from a plain thread."""

    def __init__(self, request_id: str, prompt_ids: list[int]):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._async_queue: asyncio.Queue[TokenEvent] | None = asyncio.Queue()
        except RuntimeError:
            self._loop = self._async_queue = None
        self._sync_queue: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self.finish_reason: FinishReason | None = None
        self.last_event: TokenEvent | None = None

    def _push(self, event: TokenEvent) -> None:  # engine thread
        if self._loop is not None and self._async_queue is not None:  # both set together, in an event loop
            try:
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, event)
            except RuntimeError:  # the caller's loop is gone; nobody is listening
                pass
        else:
            self._sync_queue.put(event)

    async def events(self) -> AsyncGenerator[TokenEvent, None]:
        if self._async_queue is None:
            raise RuntimeError("this handle was created outside an event loop; use wait()")
        while True:
            event = await self._async_queue.get()
            yield event
            if event.finished:
                self.finish_reason = event.finish_reason
                return

    def wait(self, timeout: float | None = None) -> Finished:
        """Block until the request finishes: its generated token ids, finish reason and error; the last event, with
        the stop reason, is `last_event`."""
        tokens: list[int] = []
        for event in self.sync_events(timeout):
            tokens.extend(event.token_ids)
        assert self.last_event is not None and self.last_event.finish_reason is not None  # the last event finished it
        return Finished(tokens, self.last_event.finish_reason, self.last_event.error)

    def sync_events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """The request's events from a plain thread, blocking up to `timeout` for each, until it finishes."""
        if self._loop is not None:
            raise RuntimeError("this handle belongs to an event loop; iterate events() instead")
        while True:
            event = self._sync_queue.get(timeout=timeout)
            yield event
            if event.finished:
                self.finish_reason, self.last_event = event.finish_reason, event
                return


# What each --disaggregation-mode takes, for the error a request another role would take gets (Engine.submit).
ROLE_REQUESTS = {
    "prefill": "this server runs --disaggregation-mode prefill: it prefills prompts for decode servers and hands "
    "their state off; send completions to `jaxserve router`",
    "decode": "this server runs --disaggregation-mode decode: each request's prompt state comes from a prefill server",
    "null": "this server runs no --disaggregation-mode: it neither hands states off nor takes them",
}

# How long shutdown() waits for the loop after fail(): a step it waits on may never end (a lost process's group).
FAILED_LOOP_JOIN_S = 1.0

# The latest steps, for tests and debugging: ~290 B each, so 30 MB at most (1M steps kept 290 MB).
STEP_RECORD_LENGTH = 100_000


@dataclass(frozen=True)
class StepRecord:
    kind: StepKind
    forced_by: str | None  # the step policy that put this decode ahead of prefill (its name)
    request_ids: tuple[str, ...]
    num_tokens: int
    started: float
    ended: float


@dataclass
class _InFlight:
    plan: StepPlan
    step: PendingStep
    dispatched_at: float

    def device_start(self, previous_end: float) -> float:
        """When the device could start it: its dispatch, or the end of the step before it, whichever is later."""
        return max(self.dispatched_at, previous_end)

    @property
    def failed_to_start(self) -> bool:
        return isinstance(self.step, _FailedDispatch)


@dataclass
class _FailedDispatch:
    """A step whose dispatch raised: waiting for it raises that error, so it fails in step order like any other."""

    error: Exception

    def sample(self) -> None:
        pass

    def result(self):
        raise self.error


@dataclass
class Counters:
    """The engine's own totals (the scheduler counts the steps)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    drafts: DraftStats = field(default_factory=lambda: DraftStats())

    def note_drafts(self, proposed: int, accepted: int) -> None:
        """One verify row: `proposed` drafts, of which the first `accepted` were kept."""
        if proposed:
            self.drafts = self.drafts.plus(proposed, accepted)


@dataclass(frozen=True)
class DraftStats:
    """Speculative decoding's totals, as vLLM counts them: verify rows that carried drafts, drafts, accepted drafts,
    and accepted drafts by their position in the row (0: the first draft)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    def plus(self, proposed: int, accepted: int) -> DraftStats:
        per_position = list(self.accepted_per_position) + [0] * max(0, proposed - len(self.accepted_per_position))
        for position in range(accepted):
            per_position[position] += 1
        return DraftStats(
            self.drafts + 1, self.draft_tokens + proposed, self.accepted_tokens + accepted, tuple(per_position)
        )

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class EngineStats:
    """One snapshot of the engine: requests by state, KV pages, steps and tokens. /metrics, the stats log line and
    the benchmarks all read this (Engine.stats())."""

    waiting: int = 0  # queued for admission
    prefilling: int = 0  # admitted, prompt not fully scheduled
    decoding: int = 0
    free_pages: int = 0
    total_pages: int = 1
    steps: StepCounts = field(default_factory=StepCounts)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    prefix_cache: PrefixStats = field(default_factory=PrefixStats)  # prompt tokens looked up and found
    drafts: DraftStats = field(default_factory=DraftStats)  # speculative decoding's (all zero without it)

    @property
    def running(self) -> int:
        """Admitted and unfinished: prefilling or decoding (vLLM's num_requests_running)."""
        return self.prefilling + self.decoding

    @property
    def kv_usage(self) -> float:
        return 1 - self.free_pages / self.total_pages


class EngineListener(Protocol):
    """Told, on the engine thread, of each completed step and each finished request (the server's per-step and
    per-request histograms); it must be quick, the next step waits for it."""

    def on_step(self, num_tokens: int) -> None: ...

    def on_finish(self, request: Request) -> None: ...


class PendingStep(Protocol):
    def sample(self) -> None:
        """Launch the step's sampling, once every token before this step's is delivered (its rows' token masks
        depend on them); result() launches it if nobody did."""

    def result(self) -> StepOutput: ...


class StepRunner(Protocol):
    """What the engine needs of the device side (jaxserve.runner.ModelRunner; tests use a fake)."""

    geometry: CacheGeometry
    buckets: Buckets

    def warmup(self, shapes=None, show_progress: bool = False, stop=None) -> None: ...

    def limits(self) -> StepLimits | None:
        """What the compiled shapes allow a step to carry; None until a prefill and a decode shape are compiled."""

    def dispatch(self, batch: StepBatch) -> PendingStep:
        """Start the step `batch` (a plan's host arrays: the runner never sees a request); `result()` waits for its
        StepOutput (each row's token and the logprobs it asked for)."""

    def cache_lost(self) -> bool: ...

    def reset_cache(self) -> None: ...

    def export_state(self, pages: list[int], slot: int) -> Parcel:
        """A sequence's state at `pages` and `slot`, copied out of the cache (a prefill server's hand-off)."""

    def install_state(self, parcel: Parcel, pages: list[int], slot: int, token: int) -> None:
        """A parcel's state written into `pages` and `slot`, whose next input token is `token` (a decode server's)."""


class Engine:
    """The loop over a runner (jaxserve.runner.build_runner, or any StepRunner); one compiled runner can serve
    several engines in turn.

    Owns, for every request: admission (check_admission), when and why it finishes (EOS ids, stop tokens,
    max_tokens, the context limit, aborts), and the counters that /metrics and the logs read."""

    def __init__(
        self,
        engine_cfg: EngineConfig,
        model_cfg: ModelConfig,
        runner: StepRunner,
        eos_token_ids: Iterable[int],
        grammars: GrammarCompiler | None = None,
    ):
        self.config = engine_cfg
        self.grammars = grammars  # structured outputs (None: no tokenizer, so none can be compiled)
        self.model_config = model_cfg
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = resolve_max_model_len(engine_cfg, model_cfg)
        geometry = runner.geometry
        if geometry.num_slots < engine_cfg.max_num_seqs or geometry.max_tokens_per_seq < self.max_model_len:
            raise ValueError(
                f"the runner's KV geometry {geometry} holds fewer than max_num_seqs="
                f"{engine_cfg.max_num_seqs} sequences of max_model_len={self.max_model_len} tokens"
            )
        if engine_cfg.mixed_steps:
            _check_mixed_steps(engine_cfg, runner.buckets)
        if engine_cfg.draft_tokens:
            log.info("speculative decoding: %d %s drafts a step", engine_cfg.draft_tokens, engine_cfg.drafter)
        self.runner = runner
        self.geometry = geometry
        if engine_cfg.enable_prefix_caching and not geometry.num_snapshots:
            log.warning(
                "prefix caching is off: the runner's KV geometry has no snapshot rows (it was built with "
                "--no-enable-prefix-caching or --prefix-cache-snapshots 0)"
            )
        snapshot_rows = geometry.snapshot_rows if engine_cfg.enable_prefix_caching else ()
        # What else a page's contents depend on than its tokens: the model and how the cache stores it.
        salt = repr((model_cfg, geometry.kv_cache_dtype)).encode()
        # A decode server caches pages without snapshots: a remote request's sequence state arrives whole.
        decode_server = engine_cfg.disaggregation_mode == "decode"
        self.pages = PrefixCache(
            IdAllocator(geometry.num_pages, "KV pages"),
            geometry.page_size,
            list(snapshot_rows),
            salt,
            pages_only=decode_server and engine_cfg.enable_prefix_caching,
        )
        self.scheduler = build_scheduler(engine_cfg, self.pages, geometry.page_size, min(runner.buckets.prefill_chunks))
        self.step_record: deque[StepRecord] = deque(maxlen=STEP_RECORD_LENGTH)
        self.counters = Counters()
        self.listeners: list[EngineListener] = []  # added before start()
        self._inbox: queue.SimpleQueue[_Submit | _Abort | _Arrived] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._decodes_since_log = 0
        # Every submitted, unfinished request with its handle: the one record of liveness. Submitting threads
        # add, the loop thread removes; both under this condition, which drain() waits on.
        self._admission = threading.Condition()
        self._live: dict[str, _Live] = {}
        self._draining = False
        # Remote requests' state sources until they are admitted, then what each was asked until its state arrives;
        # the threads that wait for it.
        self._sources: dict[str, StateSource] = {}
        self._asked: dict[str, tuple[StateSource, PrefillAsk]] = {}
        # A prefill server's handed-off requests: their state, copied out right behind the step that completed their
        # prompt (or why it could not be), until their first token is delivered.
        self._parcels: dict[str, Parcel | Exception] = {}
        self._fetching = ThreadPoolExecutor(max(1, engine_cfg.max_num_seqs), thread_name_prefix="jaxserve-fetch")
        # Loop thread only: dispatched, unfinished steps per request, and when the device is done with the last one.
        self._inflight: collections.Counter[str] = collections.Counter()
        self._device_free_at = 0.0
        self._waiting_since: float | None = None  # time.monotonic() since the loop waits for a step's result
        # Set once (fail()): why the engine stopped for good; a multi-process group's steps all fail together
        # (jaxserve.runner.group), so there a failed step fails the engine rather than only its requests.
        self._failure: str | None = None
        self.fatal_step_errors = False
        self._publish_stats()

    @property
    def context_limit(self) -> int:
        """Prompt + completion tokens one request may have: max_model_len, or less if the KV pool is smaller."""
        return min(self.max_model_len, self.geometry.num_pages * self.geometry.page_size)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self, show_progress: bool = False) -> Engine:
        """Start the loop, first compiling what serving one request at a time needs if nothing is compiled yet; the
        runner's other shapes may compile later (runner.warmup()): steps use only what is compiled."""
        if self.runner.limits() is None:
            self.runner.warmup(self.runner.buckets.first_shapes(), show_progress=show_progress)
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._fetching.shutdown(wait=False, cancel_futures=True)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:  # after fail() the loop may wait on a step that never ends: not for long
            self._thread.join(timeout=None if self._failure is None else FAILED_LOOP_JOIN_S)

    @property
    def is_running(self) -> bool:
        """Warmed up and looping (False before start(), after shutdown() or fail(), or if the loop thread died)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def failure(self) -> str | None:
        """Why the engine stopped for good (fail()), or None."""
        return self._failure

    def waiting_since(self) -> float | None:
        """time.monotonic() when the loop began waiting for the step it waits for now; None when it waits for none."""
        return self._waiting_since

    def fail(self, reason: str) -> None:
        """Stop for good, from any thread: every unfinished request ends with an error saying `reason`, nothing new
        is admitted, the loop stops. For a device that can no longer run steps (a multi-process group that lost a
        process): the loop may be blocked in a step that will never end, so this neither waits for it nor touches
        the scheduler; the process is expected to exit."""
        with self._admission:
            if self._failure is not None:
                return
            self._failure = reason
            self._draining = True
            live, self._live = list(self._live.values()), {}
            self._admission.notify_all()
        self._stop.set()
        self._wake.set()
        log.error("engine stopped: %s; %d unfinished requests end with this error", reason, len(live))
        for entry in live:
            entry.handle._push(TokenEvent((), finish_reason=FinishReason.ERROR, error=reason))

    @property
    def is_draining(self) -> bool:
        return self._draining

    def drain(self, timeout: float) -> int:
        """Stop admitting (submit raises EngineDraining), wait up to `timeout` seconds for every submitted request
        to finish, then abort the rest; returns how many were aborted."""
        with self._admission:
            self._draining = True
            self._admission.wait_for(lambda: not self._live, timeout=timeout)
            leftover = list(self._live)
        for request_id in leftover:
            self.abort(request_id)
        return len(leftover)

    # ---- public API (any thread) -----------------------------------------------------------------------------
    def check_token_ids(self, param: str, ids, positions: bool = True) -> None:
        """Raise InvalidRequest naming `param` (with `positions`, the position of each) and every id outside the
        model's vocabulary."""
        vocab = self.model_config.vocab_size
        bad = [(i, int(token)) for i, token in enumerate(ids) if not 0 <= int(token) < vocab]
        if not bad:
            return
        if not positions:  # ids that key a mapping: each named once
            bad = list({token: (i, token) for i, token in bad}.values())
        where = listed([f"{param}[{i}]" for i, _ in bad]) if positions else param
        tokens = listed([token for _, token in bad])
        what = f"token id {tokens} is" if len(bad) == 1 else f"token ids {tokens} are"
        raise InvalidRequest(param, f"{where}: {what} outside the vocabulary [0, {vocab})")

    @property
    def takes_constraints(self) -> bool:
        """Whether a request may carry a structured output constraint here: check_admission refuses one without a
        grammar compiler or with speculative decoding."""
        return self.grammars is not None and not self.config.draft_tokens

    def check_admission(self, prompt_ids: list[int], sampling: SamplingParams, priority: int = 0) -> None:
        """Raise InvalidRequest, naming the field, for a request that is invalid or could never fit (or asks for a
        priority the queue order does not use)."""
        self.scheduler.prefill_manager.queue_order.check_priority(priority)
        if self.config.draft_tokens and (field := sampling.drafting_conflict()) is not None:
            if field == "response_format" and sampling.constraint is not None:
                field = sampling.constraint.field
            raise InvalidRequest(
                field,
                f"{field}: not supported with speculative decoding (this server runs --speculative-config); its "
                "requests may set temperature, top_p, top_k, min_p, seed, stop and max_tokens",
            )
        self.check_token_ids("prompt", prompt_ids)
        self.check_token_ids("stop_token_ids", sampling.stop_token_ids)
        self.check_token_ids("logit_bias", [token for token, _ in sampling.logit_bias], positions=False)
        self.check_token_ids("allowed_token_ids", sampling.allowed_token_ids or ())
        if (constraint := sampling.constraint) is not None:
            if self.grammars is None:
                raise InvalidRequest(
                    constraint.field,
                    f"{constraint.field}: structured outputs need the model's tokenizer (tokenizer.json), and this "
                    "engine has none",
                )
            self.grammars.check(constraint)
        if not prompt_ids:
            raise InvalidRequest("prompt", "prompt: must not be empty (there is no position to sample from)")
        limit, prompt_len, completion = self.context_limit, len(prompt_ids), sampling.max_tokens
        if prompt_len + completion > limit:
            # The wording OpenAI clients match on; the field at fault is the prompt once it alone fills the context.
            param, value = ("max_tokens", completion) if prompt_len < limit else ("prompt", prompt_len)
            raise InvalidRequest(
                param,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + completion} tokens ({prompt_len} in the messages, "
                f"{completion} in the completion). Please reduce the length of the messages "
                f"or completion. (parameter={param}, value={value})",
            )

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        hand_off_from: int | None = None,
        remote: StateSource | None = None,
    ) -> RequestHandle:
        """Queue a request; raises InvalidRequest at once for one that is invalid or can never fit, QueueFull when
        `max_queued_requests` are already waiting, EngineDraining once drain() was called. `priority`: lower is
        admitted first under --scheduling-policy priority (elsewhere only 0 is accepted). Disaggregated serving:
        `hand_off_from` (a prefill server's request) ends the request after its first token, its last event carrying
        its state from that page on; `remote` (a decode server's) is where its prompt's state comes from."""
        sampling = sampling or SamplingParams()
        mode = self.config.disaggregation_mode
        if (mode == "prefill") != (hand_off_from is not None) or (mode == "decode") != (remote is not None):
            raise InvalidRequest(None, ROLE_REQUESTS[mode])
        self.check_admission(prompt_ids, sampling, priority)
        request_id = request_id or f"req-{next(self._ids)}"
        seed = zlib.crc32(f"{self.config.seed}:{request_id}".encode()) if sampling.seed is None else sampling.seed
        sampling = dataclasses.replace(sampling, seed=seed, eos_token_ids=tuple(sorted(self.eos_token_ids)))
        request = Request(
            request_id,
            [int(t) for t in prompt_ids],
            sampling,
            priority=priority,
            hand_off_from=hand_off_from,
            remote=remote is not None,
        )
        if sampling.constraint is not None and self.grammars is not None:  # check_admission refused it otherwise
            request.grammar = self.grammars.matcher(sampling.constraint)
        handle = RequestHandle(request_id, request.prompt_ids)
        with self._admission:
            if self._draining:
                raise EngineDraining("the engine is shutting down and admits no new requests")
            if request_id in self._live:
                raise InvalidRequest("request_id", f"request_id: {request_id!r} is already running")
            queued = sum(entry.request.status is RequestStatus.WAITING for entry in self._live.values())
            if queued >= self.config.max_queued_requests:
                raise QueueFull(
                    f"{queued} requests are already waiting (max_queued_requests={self.config.max_queued_requests})"
                )
            self._live[request_id] = _Live(request, handle)
            if remote is not None:
                self._sources[request_id] = remote
            self._inbox.put(_Submit(request))
        self._wake.set()
        return handle

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, stop_reason: str | None = None) -> None:
        """Finish a request at the next step boundary and return its pages; unknown or finished ids are ignored.
        `reason` is what it finishes with: a caller that matched a stop string says STOP and which string."""
        self._inbox.put(_Abort(request_id, FinishReason(reason), stop_reason))
        self._wake.set()

    def stats(self) -> EngineStats:
        """A snapshot published by the engine thread after every step (safe to call from any thread)."""
        return self._stats

    def _publish_stats(self) -> None:  # engine thread
        sched = self.scheduler
        states = collections.Counter(r.status for r in sched.prefill_manager.requests + sched.decode_manager.running)
        self._stats = EngineStats(
            waiting=states[RequestStatus.WAITING],
            prefilling=states[RequestStatus.PREFILLING],
            decoding=states[RequestStatus.DECODING],
            free_pages=self.pages.num_free,
            total_pages=self.pages.pages.size,
            prefix_cache=self.pages.stats,
            steps=sched.counts.copy(),
            prompt_tokens=self.counters.prompt_tokens,
            generation_tokens=self.counters.generation_tokens,
            finished=dict(self.counters.finished),
            drafts=self.counters.drafts,
        )

    # ---- the loop (engine thread) ----------------------------------------------------------------------------
    def _loop(self) -> None:
        inflight: _InFlight | None = None
        limits = None
        while not self._stop.is_set():
            if (current := self.runner.limits()) is not limits:  # more shapes compiled: bigger steps allowed
                limits = current
                if limits is not None:  # start() compiled the first shapes: never None here
                    self.scheduler.set_step_limits(limits)
            self._drain_inbox()
            self._fetch_remote_states()
            self.scheduler.note_inflight(
                *((inflight.plan, inflight.device_start(self._device_free_at)) if inflight else (None,))
            )
            plan = self.scheduler.schedule()
            dispatched = self._dispatch(plan) if plan is not None else None
            if plan is not None:
                self._publish_stats()  # admission took pages before any of this step's tokens can be delivered
            # Overlap: the step just dispatched runs on the device while the host finishes the one before it.
            landed = inflight
            if landed is not None:
                self._complete(landed)
            if dispatched is not None:  # its forward runs; its sampling needs the tokens just delivered
                self._launch_sampling(dispatched)
            inflight = dispatched
            # A step that could not even start fails now, after the one before it delivered: tokens come in step
            # order, so a request gets what earlier steps computed for it before its error.
            if inflight is not None and (inflight.failed_to_start or not self.config.overlapped):
                self._complete(inflight)
                inflight = None
            # Idle only when nothing was scheduled and nothing landed: a step that lands can make work (a request it
            # finished frees pages for a waiting one), and waiting here would hold that back by the whole timeout.
            if plan is None and landed is None:
                self._publish_stats()  # a step publishes when it completes; aborts and arrivals when idle
                self._wake.wait(timeout=0.05)
                self._wake.clear()
        if inflight is not None:
            self._complete(inflight)

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Submit):  # an abort of it is behind it in the inbox
                self.scheduler.add_request(message.request)
                continue
            if isinstance(message, _Arrived):
                self._install(message.request, message.ask, message.arrival)
                continue
            live = self._live.get(message.request_id)
            if live is not None:
                self._finish(live.request, message.reason, message.stop_reason)

    # ---- disaggregated serving (engine thread) ---------------------------------------------------------------
    def _fetch_remote_states(self) -> None:
        """Admit the remote requests that fit and ask, each on a worker thread, for its state."""
        for request in self.scheduler.admit_remote():
            source = self._sources.pop(request.request_id)
            ask = PrefillAsk(
                request.request_id,
                request.prompt_ids,
                request.sampling,
                skip_pages=request.num_cached_tokens // self.geometry.page_size,
            )
            self._asked[request.request_id] = (source, ask)
            self._fetching.submit(self._fetch, request, source, ask)

    def _fetch(self, request: Request, source: StateSource, ask: PrefillAsk) -> None:  # a worker thread
        try:
            arrival: Arrival | Exception = source.fetch(ask)
        except Exception as error:  # noqa: BLE001 - the request fails with it, the engine goes on
            arrival = error
        self._inbox.put(_Arrived(request, ask, arrival))
        self._wake.set()

    def _install(self, request: Request, ask: PrefillAsk, arrival: Arrival | Exception) -> None:
        """Put a remote request's arrived state in its pages and slot and deliver its first token; a request aborted
        meanwhile gave its pages back when it finished, so what arrived for it is dropped."""
        self._asked.pop(request.request_id, None)
        if request.finished:
            return
        if isinstance(arrival, Exception):
            log.warning("request %s: its state did not come: %s", request.request_id, arrival)
            self._finish(request, FinishReason.ERROR, error=f"prefill failed: {arrival}")
            return
        request.prompt_logprobs.extend(arrival.prompt_logprobs or ())
        if arrival.parcel is None or arrival.token is None:  # prefill only (max_tokens 0): nothing to decode here
            self._finish(request, FinishReason.LENGTH, prompt_logprobs=self._prompt_logprobs(request))
            return
        assert request.slot is not None  # admitted
        try:
            self.runner.install_state(
                arrival.parcel, self._state_pages(request, ask.skip_pages), request.slot, arrival.token
            )
        except Exception as error:  # noqa: BLE001 - one bad arrival must not take the server down
            log.exception("request %s: installing its state failed", request.request_id)
            self._fail_requests([request], error)
            return
        self.scheduler.arrived(request)
        self._deliver(request, (arrival.token,), arrival.logprob)

    def _state_pages(self, request: Request, first: int) -> list[int]:
        """The pages of `request`'s prompt from page `first` on: those a hand-off sends (the ones before, the
        receiving server holds already)."""
        return request.pages[first : pages_needed(request.prompt_len, self.geometry.page_size)]

    def _export_hand_offs(self, plan: StepPlan) -> None:
        """Copy out the state of the handed-off requests whose prompt `plan` completes, right behind it on the device:
        the copy waits for this step only, not for the next one (dispatched before this one's tokens are delivered)."""
        for request in plan.completed:
            if request.hand_off_from is None:
                continue
            assert request.slot is not None
            try:
                pages = self._state_pages(request, request.hand_off_from)
                self._parcels[request.request_id] = self.runner.export_state(pages, request.slot)
            except Exception as error:  # noqa: BLE001 - the request fails with it, the engine goes on
                log.exception("request %s: exporting its state failed", request.request_id)
                self._parcels[request.request_id] = error

    def _hand_off(self, request: Request, out: RowOutput) -> None:
        """A prefill server's request after its first token: its state from `hand_off_from` on leaves with its last
        event; its pages stay in the prefix cache as any finished request's do."""
        parcel = self._parcels.pop(request.request_id)
        if isinstance(parcel, Exception):
            self._finish(request, FinishReason.ERROR, error=f"exporting the state failed: {parcel}")
            return
        request.note_token(out.token_id)
        self.counters.generation_tokens += 1
        self._finish(
            request,
            FinishReason.LENGTH,
            final_tokens=(out.token_id,),
            logprobs=None if out.logprob is None else (out.logprob,),
            prompt_logprobs=self._prompt_logprobs(request),
            parcel=parcel,
        )

    def _dispatch(self, plan: StepPlan) -> _InFlight:
        dispatched = time.perf_counter()
        try:
            step = self.runner.dispatch(StepBatch.of(plan))
        except Exception as error:  # noqa: BLE001 - one bad step must not take the server down
            step = _FailedDispatch(error)
        for request in plan.requests:
            self._inflight[request.request_id] += 1
        if not isinstance(step, _FailedDispatch):
            self._export_hand_offs(plan)
        return _InFlight(plan, step, dispatched)

    @staticmethod
    def _launch_sampling(inflight: _InFlight) -> None:
        try:
            inflight.step.sample()
        except Exception as error:  # noqa: BLE001 - it fails its step, in step order, like a failed dispatch
            inflight.step = _FailedDispatch(error)

    def _complete(self, inflight: _InFlight) -> None:
        """Wait for a dispatched step's tokens, deliver them and run the stop checks."""
        plan = inflight.plan
        self._waiting_since = time.monotonic()
        try:
            output = inflight.step.result()
        except Exception as error:  # noqa: BLE001 - one bad step must not take the server down
            self._landed(plan)
            self._fail_step(plan, error)
            return
        finally:
            self._waiting_since = None
        # Steps run in order: this one started when it was dispatched or when the one before it ended (known by now,
        # as the one before completed first), so a step's time never includes the one it queued behind.
        started, ended = inflight.device_start(self._device_free_at), time.perf_counter()
        self._device_free_at = ended
        self._landed(plan)
        self.counters.prompt_tokens += plan.num_prefill_tokens
        # A request finished while this step was in flight (a stop, an abort) may have had a token computed here:
        # it is never delivered.
        for row, out in zip(plan.rows, output.prefill + output.decode):
            request = row.request
            if request.finished:
                continue
            if out.prompt_logprobs is not None:
                request.prompt_logprobs.extend(out.prompt_logprobs)
            if not row.samples_output:
                continue
            if request.sampling.max_tokens == 0:  # prefill only: the token after the prompt is unused
                self._finish(request, FinishReason.LENGTH, prompt_logprobs=self._prompt_logprobs(request))
                continue
            if request.hand_off_from is not None:
                self._hand_off(request, out)
                continue
            if out is RowOutput.NONE:  # the device saw the request at its max_tokens, which ended it on a step before
                log.error("request %s: a verify row kept no token, but the request runs", request.request_id)
                self._finish(request, FinishReason.ERROR, error="the device found the request past its max_tokens")
                continue
            if row.decode and self.config.draft_tokens:  # a verify row: its accepted drafts, then one sampled token
                self.scheduler.note_accepted(request, len(out.accepted))
                self.counters.note_drafts(out.drafted, len(out.accepted))
            # after the prompt: the first output token; after a decode row: the next, or a verify row's run
            self._deliver(request, out.token_ids, out.logprob)
        seconds = ended - started
        self.scheduler.on_step_done(plan, seconds)
        self.step_record.append(
            StepRecord(
                plan.kind, plan.forced_by, tuple(r.request_id for r in plan.requests), plan.num_tokens, started, ended
            )
        )
        for listener in self.listeners:
            listener.on_step(plan.num_tokens)
        self._publish_stats()
        self._log_step(plan, seconds)  # reads the counts just published

    def _landed(self, plan: StepPlan) -> None:
        """`plan` no longer runs: requests it was the last step in flight of get their pages and slot back."""
        for request in plan.requests:
            self._inflight[request.request_id] -= 1
            if not self._inflight[request.request_id]:
                del self._inflight[request.request_id]
                if request.finished:
                    self.scheduler.release(request)

    def _deliver(self, request: Request, tokens: tuple[int, ...], logprob: TokenLogprob | None) -> None:
        """A row's new tokens in one event, as vLLM streams a step's output: a verify row's accepted drafts and its
        sampled token together (one chunk to the client, not one a token). A stop inside the run ends the request
        exactly there: its final event carries the tokens up to it. `logprob`: a one-token row's (verify rows return
        none: `SamplingParams.drafting_conflict` refuses logprobs with drafting)."""
        first = not request.output_ids  # this event carries the request's first token, and so its prompt logprobs
        reason: FinishReason | None = None
        stop_reason: int | str | None = None
        for i, token in enumerate(tokens):
            request.note_token(token)
            self.counters.generation_tokens += 1
            if request.grammar is not None:
                broken = request.grammar.accept(token)
                if broken is not None:  # the mask allowed only what the grammar accepts: a bug, not the client's
                    log.error("request %s: token %d broke its structured output: %s", request.request_id, token, broken)
                    error = f"structured output: {broken}"
                    self._finish(request, FinishReason.ERROR, final_tokens=tokens[:i], error=error)
                    return
            complete = request.grammar is not None and request.grammar.finished
            reason, stop_reason = request.sampling.stop_reason(token, len(request.output_ids), complete)
            if reason is not None:
                tokens = tokens[: i + 1]
                break
        logprobs = None if logprob is None else (logprob,)
        prompt_logprobs = self._prompt_logprobs(request) if first else None
        if reason is None:
            live = self._live.get(request.request_id)
            if live is None:  # fail() already ended it
                return
            live.handle._push(
                TokenEvent(
                    tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, cached_tokens=request.num_cached_tokens
                )
            )
        else:
            self._finish(
                request, reason, stop_reason, final_tokens=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs
            )

    @staticmethod
    def _prompt_logprobs(request: Request) -> tuple[TokenLogprob, ...] | None:
        """What the request's first event carries, once its whole prompt has run: its prompt logprobs, if asked."""
        return None if request.sampling.prompt_logprobs is None else tuple(request.prompt_logprobs)

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        stop_reason: int | str | None = None,
        final_tokens: tuple[int, ...] = (),
        error: str | None = None,
        logprobs: tuple[TokenLogprob, ...] | None = None,
        prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
        parcel: Parcel | None = None,
    ) -> None:
        self._sources.pop(request.request_id, None)  # a remote request that ends before its state was asked for
        if (asked := self._asked.pop(request.request_id, None)) is not None:  # or while it is being made
            source, ask = asked
            self._fetching.submit(source.cancel, ask)
        self._parcels.pop(request.request_id, None)  # a handed-off one that ends before its first token
        # Pages and slot wait for the last dispatched step that still writes them (see _landed).
        self.scheduler.finish(request, reason, stop_reason, release=request.request_id not in self._inflight)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        for listener in self.listeners:
            listener.on_finish(request)
        with self._admission:
            live = self._live.pop(request.request_id, None)
            self._admission.notify_all()
        if live is None:  # fail() already ended it
            return
        live.handle._push(
            TokenEvent(
                final_tokens,
                finish_reason=reason,
                stop_reason=stop_reason,
                error=error,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                cached_tokens=request.num_cached_tokens,
                parcel=parcel,
            )
        )

    def _fail_step(self, plan: StepPlan, error: Exception) -> None:
        log.exception("step failed (%s step of %d requests)", plan.kind.value, len(plan.requests))
        if self.fatal_step_errors:
            self.fail(f"a step failed: {type(error).__name__}: {error}")
            return
        self.pages.clear()  # the pages and snapshots the step was to write may not be there
        self._fail_requests([r for r in plan.requests if not r.finished], error)

    def _fail_requests(self, failed: list[Request], error: Exception) -> None:
        """End `failed` with `error`, or every live request if the failed call consumed the donated cache."""
        if self.runner.cache_lost():
            # The donated cache went with the failed call: every sequence's KV state is gone, not only the step's.
            self.pages.clear()
            self.runner.reset_cache()
            failed = [entry.request for entry in self._live.values() if not entry.request.finished]
        for request in failed:
            self._finish(request, FinishReason.ERROR, error=f"{type(error).__name__}: {error}")

    def _log_step(self, plan: StepPlan, seconds: float) -> None:
        st = self._stats
        kv = f"KV use {st.kv_usage:.1%}"
        if plan.prefill:
            mixed = f" + {len(plan.decode)} decoding" if plan.decode else ""
            log.info(
                "Prefill batch%s: %d new tokens, %d rows%s, running %d, waiting %d, %s, %.3f s",
                " (mixed)" if plan.decode else "",
                plan.num_prefill_tokens,
                len(plan.prefill),
                mixed,
                st.running,
                st.waiting,
                kv,
                seconds,
            )
            return
        self._decodes_since_log += 1
        if plan.forced_by is not None:
            log.info(
                "Decode batch (%s): %d requests, waiting %d, %s, %.3f s",
                self.scheduler.policy_named(plan.forced_by).describe(),
                len(plan.decode),
                st.waiting,
                kv,
                seconds,
            )
        elif self._decodes_since_log >= self.config.decode_log_interval:
            log.info("Decode batch: %d requests, waiting %d, %s, %.3f s", len(plan.decode), st.waiting, kv, seconds)
        else:
            return
        self._decodes_since_log = 0


def _check_mixed_steps(cfg: EngineConfig, buckets: Buckets) -> None:
    """Mixed steps need a runner compiled with them and a chunk longer than the decode rows they carry. A default
    that cannot mix is said loudly; mixed steps the user asked for are refused."""
    if not buckets.mixed:
        why = "the runner was built without mixed step shapes (build_runner builds them)"
    elif buckets.mixed_shape(GroupShape(1, max(buckets.prefill_chunks))) is None:
        rows, tokens = buckets.mixed_decode_group.rows, buckets.decode_row_tokens
        why = (
            f"a mixed step's chunk is --chunked-prefill-size ({cfg.chunked_prefill_size}) minus its decode rows' "
            f"tokens ({rows} rows, --max-num-seqs, x {tokens} a row), which leaves nothing"
        )
    else:
        return
    if cfg.mixed_batches:
        raise ConfigError(f"--mixed-batches: {why}")
    log.warning(
        "prefill steps will not carry decode rows (the default mixed steps are off): %s; running requests "
        "wait for whole prefill bursts (--decode-interleave-every N bounds that)",
        why,
    )
