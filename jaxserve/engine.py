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
from dataclasses import dataclass, field
from typing import AsyncIterator

from typing import Iterable, Protocol

from jaxserve.cache import CacheGeometry, resolve_max_model_len
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.request import Batch, InvalidRequest, Request, RequestStatus, SamplingParams, TokenLogprob
from jaxserve.runner import Buckets, StepLimits, StepResult
from jaxserve.scheduler import (DecodeInterleavePolicy, DecodeManager, DecodeStallPolicy, IdAllocator, PrefillManager,
                                Scheduler)

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
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
        self.finish_reason: str | None = None
        self.last_event: TokenEvent | None = None

    def _push(self, event: TokenEvent) -> None:  # engine thread
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, event)
            except RuntimeError:  # the caller's loop is gone; nobody is listening
                pass
        else:
            self._sync_queue.put(event)

    async def events(self) -> AsyncIterator[TokenEvent]:
        if self._async_queue is None:
            raise RuntimeError("this handle was created outside an event loop; use wait()")
        while True:
            event = await self._async_queue.get()
            yield event
            if event.finished:
                self.finish_reason = event.finish_reason
                return

    def wait(self, timeout: float | None = None) -> tuple[list[int], str, str | None]:
        """Block until the request finishes: (all generated token ids, finish reason, error or None); the last
        event, with the stop reason, is `last_event`."""
        if self._loop is not None:
            raise RuntimeError("this handle belongs to an event loop; iterate events() instead")
        tokens: list[int] = []
        while True:
            event = self._sync_queue.get(timeout=timeout)
            tokens.extend(event.token_ids)
            if event.finished:
                self.finish_reason, self.last_event = event.finish_reason, event
                return tokens, event.finish_reason, event.error


# The latest steps, for tests and debugging: ~290 B each, so 30 MB at most (1M steps kept 290 MB).
STEP_RECORD_LENGTH = 100_000


@dataclass(frozen=True)
class StepRecord:
    kind: str  # prefill | decode | mixed
    forced_by: str | None  # the policy that put this decode ahead of prefill: interleave | stall
    request_ids: tuple[str, ...]
    num_tokens: int
    started: float
    ended: float


@dataclass
class _InFlight:
    batch: Batch
    step: "PendingStep"
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

    def result(self):
        raise self.error


@dataclass
class Counters:
    """The engine's totals; /metrics and the logs both read these (through stats())."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests


class PendingStep(Protocol):
    def result(self) -> tuple[np.ndarray, np.ndarray]: ...


class StepRunner(Protocol):
    """What the engine needs of the device side (jaxserve.runner.ModelRunner; tests use a fake)."""

    geometry: CacheGeometry
    buckets: Buckets

    def warmup(self, shapes=None, show_progress: bool = False, stop=None) -> None: ...

    def limits(self) -> StepLimits | None:
        """What the compiled shapes allow a step to carry; None until a prefill and a decode shape are compiled."""

    def dispatch(self, batch: Batch) -> PendingStep:
        """Start `batch`; `result()` waits for its StepResult (tokens and the logprobs rows asked for)."""

    def cache_lost(self) -> bool: ...

    def reset_cache(self) -> None: ...


class Engine:
    """The loop over a runner (jaxserve.runner.build_runner, or any StepRunner); one compiled runner can serve
    several engines in turn.

    Owns, for every request: admission (check_admission), when and why it finishes (EOS ids, stop tokens,
    max_tokens, the context limit, aborts), and the counters that /metrics and the logs read."""

    def __init__(self, engine_cfg: EngineConfig, model_cfg: ModelConfig, runner: StepRunner,
                 eos_token_ids: Iterable[int]):
        self.config = engine_cfg
        self.model_config = model_cfg
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = resolve_max_model_len(engine_cfg, model_cfg)
        geometry = runner.geometry
        if geometry.num_slots < engine_cfg.max_num_seqs or geometry.max_tokens_per_seq < self.max_model_len:
            raise ValueError(f"the runner's KV geometry {geometry} holds fewer than max_num_seqs="
                             f"{engine_cfg.max_num_seqs} sequences of max_model_len={self.max_model_len} tokens")
        if engine_cfg.mixed_batches and not runner.buckets.mixed:
            raise ValueError("mixed_batches needs a runner compiled with mixed steps (build_runner does that)")
        self.runner = runner
        self.geometry = geometry
        self.page_pool = IdAllocator(geometry.num_pages, "KV pages")
        self.scheduler = Scheduler(
            PrefillManager(self.page_pool, geometry.page_size, engine_cfg.chunked_prefill_size,
                           engine_cfg.max_prefill_rows, IdAllocator(engine_cfg.max_num_seqs, "slots")),
            DecodeManager(engine_cfg.max_num_seqs),
            DecodeInterleavePolicy(engine_cfg.decode_interleave_every),
            DecodeStallPolicy(engine_cfg.max_decode_stall_ms, page_size=geometry.page_size,
                              min_chunk_tokens=min(runner.buckets.prefill_chunks)),
            mixed_batches=engine_cfg.mixed_batches,
        )
        self.step_record: deque[StepRecord] = deque(maxlen=STEP_RECORD_LENGTH)
        self.counters = Counters()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._decodes_since_log = 0
        # Every submitted, unfinished request with its handle: the one record of liveness. Submitting threads
        # add, the loop thread removes; both under this condition, which drain() waits on.
        self._admission = threading.Condition()
        self._live: dict[str, tuple[Request, RequestHandle]] = {}
        self._draining = False
        # Loop thread only: dispatched, unfinished steps per request, and when the device is done with the last one.
        self._inflight: collections.Counter[str] = collections.Counter()
        self._device_free_at = 0.0
        self._publish_stats()

    @property
    def context_limit(self) -> int:
        """Prompt + completion tokens one request may have: max_model_len, or less if the KV pool is smaller."""
        return min(self.max_model_len, self.geometry.num_pages * self.geometry.page_size)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self, show_progress: bool = False) -> "Engine":
        """Start the loop, first compiling what serving one request at a time needs if nothing is compiled yet; the
        runner's other shapes may compile later (runner.warmup()): steps use only what is compiled."""
        if self.runner.limits() is None:
            self.runner.warmup(self.runner.buckets.first_shapes(), show_progress=show_progress)
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def is_running(self) -> bool:
        """Warmed up and looping (False before start(), after shutdown(), or if the loop thread died)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

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
    def check_token_ids(self, param: str, ids) -> None:
        """Raise InvalidRequest naming `param` and the position if an id is outside the model's vocabulary."""
        vocab = self.model_config.vocab_size
        for i, token in enumerate(ids):
            if not 0 <= int(token) < vocab:
                raise InvalidRequest(param, f"{param}[{i}]: token id {token} is outside the vocabulary [0, {vocab})")

    def check_admission(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raise InvalidRequest, naming the field, for a request that is invalid or could never fit."""
        self.check_token_ids("prompt", prompt_ids)
        self.check_token_ids("stop_token_ids", sampling.stop_token_ids)
        if not prompt_ids:
            raise InvalidRequest("prompt", "prompt: must not be empty (there is no position to sample from)")
        limit, prompt_len, completion = self.context_limit, len(prompt_ids), sampling.max_tokens
        if prompt_len + completion > limit:
            # The wording OpenAI clients match on; the field at fault is the prompt once it alone fills the context.
            param, value = ("max_tokens", completion) if prompt_len < limit else ("prompt", prompt_len)
            raise InvalidRequest(param, f"This model's maximum context length is {limit} tokens. However, you "
                                        f"requested {prompt_len + completion} tokens ({prompt_len} in the messages, "
                                        f"{completion} in the completion). Please reduce the length of the messages "
                                        f"or completion. (parameter={param}, value={value})")

    def submit(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue a request; raises InvalidRequest at once for one that is invalid or can never fit, QueueFull when
        `max_queued_requests` are already waiting, EngineDraining once drain() was called."""
        sampling = sampling or SamplingParams()
        self.check_admission(prompt_ids, sampling)
        request_id = request_id or f"req-{next(self._ids)}"
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=zlib.crc32(f"{self.config.seed}:{request_id}".encode()))
        request = Request(request_id, [int(t) for t in prompt_ids], sampling)
        handle = RequestHandle(request_id, request.prompt_ids)
        with self._admission:
            if self._draining:
                raise EngineDraining("the engine is shutting down and admits no new requests")
            if request_id in self._live:
                raise InvalidRequest("request_id", f"request_id: {request_id!r} is already running")
            queued = sum(r.status is RequestStatus.WAITING for r, _ in self._live.values())
            if queued >= self.config.max_queued_requests:
                raise QueueFull(f"{queued} requests are already waiting "
                                f"(max_queued_requests={self.config.max_queued_requests})")
            self._live[request_id] = (request, handle)
            self._inbox.put(("submit", request, None, None))
        self._wake.set()
        return handle

    def abort(self, request_id: str, reason: str = "abort", stop_reason: str | None = None) -> None:
        """Finish a request at the next step boundary and return its pages; unknown or finished ids are ignored.
        `reason` is what it finishes with: a caller that matched a stop string says "stop" and which string."""
        self._inbox.put(("abort", request_id, reason, stop_reason))
        self._wake.set()

    def stats(self) -> dict:
        """A snapshot published by the engine thread after every step (safe to call from any thread)."""
        return dict(self._stats)

    def _publish_stats(self) -> None:  # engine thread
        sched = self.scheduler
        self._stats = {
            "running": len(sched.decode_manager.running),
            "waiting": sched.prefill_manager.num_waiting,
            "free_pages": self.page_pool.num_free,
            "total_pages": self.page_pool.size,
            "kv_usage": self.page_pool.num_used / self.page_pool.size,
            "prefill_steps": sched.prefill_steps,
            "decode_steps": sched.decode_steps,
            "forced_decode_steps": sched.forced_decode_steps,
            "stall_decode_steps": sched.stall_decode_steps,
            "mixed_steps": sched.mixed_steps,
            "prompt_tokens": self.counters.prompt_tokens,
            "generation_tokens": self.counters.generation_tokens,
            "finished": dict(self.counters.finished),
        }

    # ---- the loop (engine thread) ----------------------------------------------------------------------------
    def _loop(self) -> None:
        inflight: _InFlight | None = None
        limits = None
        while not self._stop.is_set():
            if (current := self.runner.limits()) is not limits:  # more shapes compiled: bigger steps allowed
                limits = current
                self.scheduler.set_step_limits(limits.prefill_tokens, limits.prefill_rows, limits.decode_rows,
                                               limits.mixed)
            self._drain_inbox()
            self.scheduler.note_inflight(*((inflight.batch, inflight.device_start(self._device_free_at))
                                           if inflight else (None,)))
            batch = self.scheduler.schedule()
            dispatched = self._dispatch(batch) if batch is not None else None
            if batch is not None:
                self._publish_stats()  # admission took pages before any of this step's tokens can be delivered
            # Overlap: the step just dispatched runs on the device while the host finishes the one before it.
            landed = inflight
            if landed is not None:
                self._complete(landed)
            inflight = dispatched
            # A step that could not even start fails now, after the one before it delivered: tokens come in step
            # order, so a request gets what earlier steps computed for it before its error.
            if inflight is not None and (inflight.failed_to_start or not self.config.async_scheduling):
                self._complete(inflight)
                inflight = None
            # Idle only when nothing was scheduled and nothing landed: a step that lands can make work (a request it
            # finished frees pages for a waiting one), and waiting here would hold that back by the whole timeout.
            if batch is None and landed is None:
                self._publish_stats()  # a step publishes when it completes; aborts and arrivals when idle
                self._wake.wait(timeout=0.05)
                self._wake.clear()
        if inflight is not None:
            self._complete(inflight)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item, reason, stop_reason = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":  # an abort of it is behind it in the inbox
                self.scheduler.add_request(item)
                continue
            live = self._live.get(item)
            if live is not None:
                self._finish(live[0], reason, stop_reason)

    def _dispatch(self, batch: Batch) -> _InFlight:
        dispatched = time.perf_counter()
        try:
            step = self.runner.dispatch(batch)
        except Exception as error:  # noqa: BLE001 - one bad step must not take the server down
            step = _FailedDispatch(error)
        for request in batch.requests:
            self._inflight[request.request_id] += 1
        return _InFlight(batch, step, dispatched)

    def _complete(self, inflight: _InFlight) -> None:
        """Wait for a dispatched step's tokens, deliver them and run the stop checks."""
        batch = inflight.batch
        try:
            result = inflight.step.result()
        except Exception as error:  # noqa: BLE001 - one bad step must not take the server down
            self._landed(batch)
            self._fail_step(batch, error)
            return
        # Steps run in order: this one started when it was dispatched or when the one before it ended (known by now,
        # as the one before completed first), so a step's time never includes the one it queued behind.
        started, ended = inflight.device_start(self._device_free_at), time.perf_counter()
        self._device_free_at = ended
        self._landed(batch)
        self.counters.prompt_tokens += batch.num_prefill_tokens
        # A request finished while this step was in flight (a stop, an abort) may have had a token computed here:
        # it is never delivered.
        for i, chunk in enumerate(batch.prefill):
            request = chunk.request
            if request.finished:
                continue
            if result.prompt_logprobs[i] is not None:
                request.prompt_logprobs.extend(result.prompt_logprobs[i])
            if chunk.is_last and request.sampling.max_tokens == 0:  # prefill only: the sampled token is unused
                self._finish(request, "length", prompt_logprobs=self._prompt_logprobs(request))
            elif chunk.is_last:  # the token after the prompt is the first output token
                self._deliver(request, int(result.prefill_tokens[i]), result.prefill_logprobs[i])
        for request, token, logprob in zip(batch.decode, result.decode_tokens, result.decode_logprobs):
            if not request.finished:
                self._deliver(request, int(token), logprob)
        seconds = ended - started
        self.scheduler.observe_step(batch, seconds)
        self.scheduler.on_batch_done(batch)
        self.step_record.append(StepRecord(batch.phase, batch.forced_by, tuple(r.request_id for r in batch.requests),
                                           batch.num_tokens, started, ended))
        self._publish_stats()
        self._log_step(batch, seconds)  # reads the counts just published

    def _landed(self, batch: Batch) -> None:
        """`batch` no longer runs: requests it was the last step in flight of get their pages and slot back."""
        for request in batch.requests:
            self._inflight[request.request_id] -= 1
            if not self._inflight[request.request_id]:
                del self._inflight[request.request_id]
                if request.finished:
                    self.scheduler.release(request)

    def _deliver(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        request.output_ids.append(token)
        self.counters.generation_tokens += 1
        reason, stop_reason = self._stop_reason(request, token)
        logprobs = None if logprob is None else (logprob,)
        prompt_logprobs = self._prompt_logprobs(request) if len(request.output_ids) == 1 else None
        if reason is None:
            self._live[request.request_id][1]._push(TokenEvent((token,), logprobs=logprobs,
                                                               prompt_logprobs=prompt_logprobs))
        else:
            self._finish(request, reason, stop_reason, final_tokens=(token,), logprobs=logprobs,
                         prompt_logprobs=prompt_logprobs)

    def _stop_reason(self, request: Request, token: int) -> tuple[str | None, int | None]:
        """(finish reason, stop token) after `token`; EOS is reported without a stop token, as vLLM does."""
        s = request.sampling
        if not s.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if token in s.stop_token_ids:
            return "stop", token
        if len(request.output_ids) >= s.max_tokens:  # admission kept prompt + max_tokens within the context
            return "length", None
        return None, None

    @staticmethod
    def _prompt_logprobs(request: Request) -> tuple[TokenLogprob, ...] | None:
        """What the request's first event carries, once its whole prompt has run: its prompt logprobs, if asked."""
        return None if request.sampling.prompt_logprobs is None else tuple(request.prompt_logprobs)

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None = None,
                final_tokens: tuple[int, ...] = (), error: str | None = None,
                logprobs: tuple[TokenLogprob, ...] | None = None,
                prompt_logprobs: tuple[TokenLogprob, ...] | None = None) -> None:
        # Pages and slot wait for the last dispatched step that still writes them (see _landed).
        self.scheduler.finish(request, reason, stop_reason, release=request.request_id not in self._inflight)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        with self._admission:
            _, handle = self._live.pop(request.request_id)
            self._admission.notify_all()
        handle._push(TokenEvent(final_tokens, finish_reason=reason, stop_reason=stop_reason, error=error,
                                logprobs=logprobs, prompt_logprobs=prompt_logprobs))

    def _fail_step(self, batch: Batch, error: Exception) -> None:
        log.exception("step failed (%s batch of %d requests)", batch.phase, len(batch.requests))
        failed = [r for r in batch.requests if not r.finished]
        if self.runner.cache_lost():
            # The donated cache went with the failed call: every sequence's KV state is gone, not only the batch's.
            self.runner.reset_cache()
            failed = [r for r, _ in self._live.values() if not r.finished]
        for request in failed:
            self._finish(request, "error", error=f"{type(error).__name__}: {error}")

    def _log_step(self, batch: Batch, seconds: float) -> None:
        st = self._stats
        kv = f"KV use {st['kv_usage']:.1%}"
        if batch.prefill:
            mixed = f" + {len(batch.decode)} decoding" if batch.decode else ""
            log.info("Prefill batch%s: %d new tokens, %d rows%s, running %d, waiting %d, %s, %.3f s",
                     " (mixed)" if batch.decode else "", batch.num_prefill_tokens, len(batch.prefill), mixed,
                     st["running"], st["waiting"], kv, seconds)
            return
        self._decodes_since_log += 1
        if batch.forced_by == "interleave":
            log.info("Decode batch (interleaved after %d prefill steps): %d requests, waiting %d, %s, %.3f s",
                     self.config.decode_interleave_every, len(batch.decode), st["waiting"], kv, seconds)
        elif batch.forced_by == "stall":
            log.info("Decode batch (stall budget %g ms): %d requests, waiting %d, %s, %.3f s",
                     self.config.max_decode_stall_ms, len(batch.decode), st["waiting"], kv, seconds)
        elif self._decodes_since_log >= self.config.decode_log_interval:
            log.info("Decode batch: %d requests, waiting %d, %s, %.3f s", len(batch.decode), st["waiting"], kv,
                     seconds)
        else:
            return
        self._decodes_since_log = 0
