"""The engine loop: on its own thread, schedule -> run -> deliver sampled tokens -> finish and free.

Public API: `submit()` (returns a RequestHandle whose token events can be awaited from asyncio or waited for
from a thread), `abort(request_id)`, `stats()`, `step_record`, `start()` / `shutdown()`, `drain()` /
`is_draining` / `is_running`. Requests and aborts reach the loop through an inbox and take effect at the next
step boundary; all scheduler state is touched by the loop thread only.
"""

from __future__ import annotations

import asyncio
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

from jaxserve.cache import CacheGeometry, PagePool, pages_needed
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.runner import Buckets, ModelRunner, Row
from jaxserve.scheduler import (Batch, DecodeBatch, DecodeInterleavePolicy, DecodeManager, DecodeStallPolicy,
                                MixedBatch, PrefillBatch, PrefillManager, Request, SamplingParams, Scheduler)

log = logging.getLogger("jaxserve.engine")


class QueueFull(RuntimeError):
    """submit() refused a request: `max_queued_requests` requests are already waiting for admission."""


class EngineDraining(RuntimeError):
    """submit() refused a request: the engine is draining for shutdown and admits nothing new."""


@dataclass(frozen=True)
class TokenEvent:
    """What one step produced for one request: new token ids, and whether (and why) it finished."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None

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
        """Block until the request finishes: (all generated token ids, finish reason, error or None)."""
        if self._loop is not None:
            raise RuntimeError("this handle belongs to an event loop; iterate events() instead")
        tokens: list[int] = []
        while True:
            event = self._sync_queue.get(timeout=timeout)
            tokens.extend(event.token_ids)
            if event.finished:
                self.finish_reason = event.finish_reason
                return tokens, event.finish_reason, event.error


# The latest steps, for tests and debugging: ~290 B each, so 30 MB at most (1M steps kept 290 MB).
STEP_RECORD_LENGTH = 100_000


@dataclass(frozen=True)
class StepRecord:
    kind: str  # prefill | decode | mixed
    forced: bool  # a decode taken because a policy (interleave count or stall budget) said so
    request_ids: tuple[str, ...]
    num_tokens: int
    started: float
    ended: float


@dataclass
class _Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)


def kv_geometry(engine_cfg: EngineConfig, model_cfg: ModelConfig) -> tuple[CacheGeometry, int]:
    """The KV cache geometry and the effective max_model_len for these knobs."""
    max_len = engine_cfg.max_model_len or min(model_cfg.max_position_embeddings, 16384)
    if max_len > model_cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                         f"{model_cfg.max_position_embeddings}")
    per_seq = pages_needed(max_len, engine_cfg.page_size)
    num_pages = engine_cfg.num_kv_pages or engine_cfg.max_num_seqs * per_seq
    return CacheGeometry(num_slots=engine_cfg.max_num_seqs, num_pages=num_pages, page_size=engine_cfg.page_size,
                         max_pages_per_seq=per_seq), max_len


def build_runner(engine_cfg: EngineConfig, model_cfg: ModelConfig, weights, mesh) -> ModelRunner:
    geometry, _ = kv_geometry(engine_cfg, model_cfg)
    buckets = Buckets.for_limits(engine_cfg.max_prefill_rows, engine_cfg.chunked_prefill_size,
                                 engine_cfg.max_num_seqs, mixed=engine_cfg.mixed_batches)
    return ModelRunner(model_cfg, weights, geometry, mesh, buckets)


class Engine:
    """Takes its runner ready-made (see build_runner), so one compiled runner can serve several engines."""

    def __init__(self, engine_cfg: EngineConfig, model_cfg: ModelConfig, runner: ModelRunner):
        self.config = engine_cfg
        self.model_config = model_cfg
        self.geometry, self.max_model_len = kv_geometry(engine_cfg, model_cfg)
        if runner.geometry != self.geometry:
            raise ValueError(f"the runner's KV geometry {runner.geometry} does not match this config's "
                             f"{self.geometry}")
        self.runner = runner
        self.page_pool = PagePool(self.geometry.num_pages)
        self.scheduler = Scheduler(
            PrefillManager(self.page_pool, self.geometry.page_size, engine_cfg.chunked_prefill_size,
                           engine_cfg.max_prefill_rows, engine_cfg.max_num_seqs, self.max_model_len),
            DecodeManager(engine_cfg.max_num_seqs),
            DecodeInterleavePolicy(engine_cfg.decode_interleave_every),
            DecodeStallPolicy(engine_cfg.max_decode_stall_ms, page_size=self.geometry.page_size,
                              min_chunk_tokens=min(runner.buckets.prefill_chunks)),
            mixed_batches=engine_cfg.mixed_batches,
        )
        if engine_cfg.mixed_batches and not runner.buckets.mixed:
            raise ValueError("mixed_batches needs a runner compiled with mixed steps (build_runner does that)")
        self.step_record: deque[StepRecord] = deque(maxlen=STEP_RECORD_LENGTH)
        self.counters = _Counters()
        self._handles: dict[str, RequestHandle] = {}
        self._requests: dict[str, Request] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._decodes_since_log = 0
        # Admission bookkeeping shared with submitting threads (the scheduler's own queue is loop-thread only).
        self._admission = threading.Condition()
        self._queued: set[str] = set()  # submitted, not yet admitted: what max_queued_requests bounds
        self._live: set[str] = set()  # submitted, not yet finished: what drain() waits for
        self._draining = False
        self._publish_stats()

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self, show_progress: bool = False) -> "Engine":
        self.runner.warmup(show_progress=show_progress)
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
    def submit(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue a request; raises ValueError at once for one that is invalid or can never fit, QueueFull when
        `max_queued_requests` are already waiting, EngineDraining once drain() was called."""
        sampling = sampling or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=zlib.crc32(f"{self.config.seed}:{request_id}".encode()))
        request = Request(request_id, [int(t) for t in prompt_ids], sampling)
        self.scheduler.prefill_manager.check_admissible(request)
        handle = RequestHandle(request_id, request.prompt_ids)
        with self._admission:
            if self._draining:
                raise EngineDraining("the engine is shutting down and admits no new requests")
            if len(self._queued) >= self.config.max_queued_requests:
                raise QueueFull(f"{len(self._queued)} requests are already waiting "
                                f"(max_queued_requests={self.config.max_queued_requests})")
            self._queued.add(request_id)
            self._live.add(request_id)
            self._inbox.put(("submit", request, handle))
        self._wake.set()
        return handle

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request at the next step boundary and return its pages; unknown or finished ids are ignored.
        `reason` is what the request finishes with (a server that matched a stop string says "stop")."""
        self._inbox.put(("abort", request_id, reason))
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
            "total_pages": self.page_pool.num_pages,
            "kv_usage": self.page_pool.num_used / self.page_pool.num_pages,
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
        while not self._stop.is_set():
            self._drain_inbox()
            batch = self.scheduler.schedule()
            self._note_admitted(batch)
            self._publish_stats()
            if batch is None:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            self._run(batch)
            self._publish_stats()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item, extra = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._requests[item.request_id] = item
                self._handles[item.request_id] = extra
                self.scheduler.add_request(item)
            else:
                request = self._requests.get(item)
                if request is not None:
                    self._finish(request, extra)

    def _note_admitted(self, batch: Batch | None) -> None:
        # A request's first chunk is scheduled in the step that admits it (pages and slot reserved).
        prefill = _prefill_part(batch)
        if prefill is not None:
            with self._admission:
                self._queued.difference_update(c.request.request_id for c in prefill.chunks if c.start == 0)

    def _run(self, batch: Batch) -> None:
        started = time.perf_counter()
        try:
            prefill, decode = _prefill_part(batch), _decode_part(batch)
            prefill_rows = [self._row(c.request, c.token_ids, c.start) for c in prefill.chunks] if prefill else None
            decode_rows = [self._row(r, [r.output_ids[-1]], r.total_len - 1) for r in decode.requests] \
                if decode else None
            if prefill_rows and decode_rows:
                prefill_tokens, decode_tokens = self.runner.mixed(prefill_rows, decode_rows)
            elif prefill_rows:
                prefill_tokens, decode_tokens = self.runner.prefill(prefill_rows), []
            else:
                prefill_tokens, decode_tokens = [], self.runner.decode(decode_rows)
            if prefill_rows:
                self.counters.prompt_tokens += prefill.num_tokens
                for chunk, token in zip(prefill.chunks, prefill_tokens):
                    if chunk.is_last:  # the token after the prompt is the first output token
                        self._deliver(chunk.request, int(token))
            if decode_rows:
                for request, token in zip(decode.requests, decode_tokens):
                    self._deliver(request, int(token))
        except Exception as error:  # noqa: BLE001 - one bad step must not take the server down
            self._fail_step(batch, error)
            return
        ended = time.perf_counter()
        self.scheduler.observe_step(batch, ended - started)
        self.scheduler.on_batch_done(batch)
        record = StepRecord(batch.phase, isinstance(batch, DecodeBatch) and batch.forced,
                            tuple(_requests_of(batch)), batch.num_tokens, started, ended)
        self.step_record.append(record)
        self._log_step(batch, ended - started)

    def _row(self, request: Request, tokens: list[int], position: int) -> Row:
        s = request.sampling
        return Row(tokens, position, request.slot, request.pages, temperature=s.temperature, top_k=s.top_k,
                   top_p=s.top_p, seed=s.seed)

    def _deliver(self, request: Request, token: int) -> None:
        request.output_ids.append(token)
        self.counters.generation_tokens += 1
        reason = self._stop_reason(request, token)
        if reason is None:
            self._handles[request.request_id]._push(TokenEvent((token,)))
        else:
            self._finish(request, reason, final_tokens=(token,))

    def _stop_reason(self, request: Request, token: int) -> str | None:
        s = request.sampling
        if not s.ignore_eos and token == self.model_config.eos_token_id:
            return "stop"
        if token in s.stop_token_ids:
            return "stop"
        if len(request.output_ids) >= s.max_tokens or request.total_len >= self.max_model_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str, final_tokens: tuple[int, ...] = (),
                error: str | None = None) -> None:
        self.scheduler.finish(request, reason)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        self._requests.pop(request.request_id, None)
        with self._admission:
            self._queued.discard(request.request_id)
            self._live.discard(request.request_id)
            self._admission.notify_all()
        handle = self._handles.pop(request.request_id, None)
        if handle is not None:
            handle._push(TokenEvent(final_tokens, finish_reason=reason, error=error))

    def _fail_step(self, batch: Batch, error: Exception) -> None:
        log.exception("step failed (%s batch of %d requests)", batch.phase, len(_requests_of(batch)))
        failed = [self._requests[rid] for rid in _requests_of(batch) if rid in self._requests]
        if self.runner.cache_lost():
            # The donated cache went with the failed call: every sequence's KV state is gone, not only the batch's.
            self.runner.reset_cache()
            failed = list(self._requests.values())
        for request in failed:
            self._finish(request, "error", error=f"{type(error).__name__}: {error}")

    def _log_step(self, batch: Batch, seconds: float) -> None:
        self._publish_stats()
        st = self._stats
        kv = f"KV use {st['kv_usage']:.1%}"
        if isinstance(batch, PrefillBatch):
            log.info("Prefill batch: %d new tokens, %d rows, running %d, waiting %d, %s, %.3f s",
                     batch.num_tokens, len(batch.chunks), st["running"], st["waiting"], kv, seconds)
            return
        if isinstance(batch, MixedBatch):
            log.info("Prefill batch (mixed): %d new tokens, %d rows + %d decoding, running %d, waiting %d, %s, "
                     "%.3f s", batch.prefill.num_tokens, len(batch.prefill.chunks), len(batch.decode.requests),
                     st["running"], st["waiting"], kv, seconds)
            return
        self._decodes_since_log += 1
        if batch.forced_by == "interleave":
            log.info("Decode batch (interleaved after %d prefill steps): %d requests, waiting %d, %s, %.3f s",
                     self.config.decode_interleave_every, len(batch.requests), st["waiting"], kv, seconds)
        elif batch.forced_by == "stall":
            log.info("Decode batch (stall budget %g ms): %d requests, waiting %d, %s, %.3f s",
                     self.config.max_decode_stall_ms, len(batch.requests), st["waiting"], kv, seconds)
        elif self._decodes_since_log >= self.config.decode_log_interval:
            log.info("Decode batch: %d requests, waiting %d, %s, %.3f s", len(batch.requests), st["waiting"], kv,
                     seconds)
        else:
            return
        self._decodes_since_log = 0


def _prefill_part(batch: Batch | None) -> PrefillBatch | None:
    return batch.prefill if isinstance(batch, MixedBatch) else batch if isinstance(batch, PrefillBatch) else None


def _decode_part(batch: Batch | None) -> DecodeBatch | None:
    return batch.decode if isinstance(batch, MixedBatch) else batch if isinstance(batch, DecodeBatch) else None


def _requests_of(batch: Batch) -> list[str]:
    prefill, decode = _prefill_part(batch), _decode_part(batch)
    return ([c.request.request_id for c in prefill.chunks] if prefill else []) + \
        ([r.request_id for r in decode.requests] if decode else [])


