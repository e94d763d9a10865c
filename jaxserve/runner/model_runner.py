"""The device side: two jitted steps, *prefill a chunk* and *decode one step*, over weights on a mesh.

A step is two calls, launched one after the other: the forward and the sampler (jaxserve.runner.executables, which
compiles them ahead of time for a small set of shape buckets: rows x chunk length for prefill, rows for decode, the
sampler by rows; jaxserve.runner.logprobs for what logprobs leave the device). The runner is their executor: it
keeps the device state, turns each StepBatch into the calls' inputs (jaxserve.runner.inputs) and launches them. A
call whose shape is not a bucket is an error, never a silent recompile.

Each sampled token is also kept on the device, in its sequence's slot, and a decode row reads its input token from
there: a step can be dispatched before the host has seen the previous step's tokens (overlap scheduling). The
sampler is launched apart so that its inputs can wait for those tokens: a structured output's token mask depends
on every token before the one it constrains, so the engine launches step N+1's forward, delivers step N's tokens,
and only then launches N+1's sampler, whose masks the grammars compute while the forward runs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import ConfigError, EngineConfig, ModelConfig
from jaxserve.kernels.table import Kernels, kernels_for
from jaxserve.kernels.tiles import ROW_TILE
from jaxserve.model.cache import CacheGeometry, kv_geometry, zeros_of
from jaxserve.progress import progress
from jaxserve.request import TokenLogprob
from jaxserve.request.batch import GroupBatch, LateInputs, StepBatch
from jaxserve.request.step import (
    MIXED_PREFILL_ROWS,
    GroupShape,
    RowOutput,
    StepKind,
    StepLimits,
    StepOutput,
    StepShape,
)
from jaxserve.runner.executables import ExecutableCache
from jaxserve.runner.inputs import GroupInputs, StepGroup, TokenRoutes, group_inputs, padding_groups, verify_inputs
from jaxserve.runner.logprobs import LogprobInputs, Logprobs, to_host
from jaxserve.runner.mirror import Call, CallLog, CompileSync, ForwardCall, ResetCall, SampleCall
from jaxserve.runner.sampling import PENALTY_BUCKET, PenaltyArrays, SamplingArrays
from jaxserve.runner.speculative import Verified
from jaxserve.runner.transfer import Parcel, StateMover

log = logging.getLogger("jaxserve.runner")


def powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (limit,)


@jax.tree_util.register_dataclass
@dataclass
class GroupOutput:
    """One group's outputs of a step: the sampled tokens [b], their Logprobs [b], the prompt Logprobs [b, t] (None
    for a decode group: decode rows have no prompt tokens)."""

    tokens: jax.Array
    sampled: Logprobs
    prompt: Logprobs | None


@dataclass(frozen=True)
class Buckets:
    prefill_rows: tuple[int, ...]
    prefill_chunks: tuple[int, ...]
    decode_rows: tuple[int, ...]
    mixed: bool = False  # also compile prefill steps that carry a decode group
    decode_row_tokens: int = 1  # tokens a decode row carries: 1, or k + 1 where it verifies k drafts
    # EngineConfig.disaggregation_mode: a prefill server runs prefill steps only, a decode server decode steps only
    role: str = "null"

    @staticmethod
    def for_limits(
        max_prefill_rows: int,
        chunked_prefill_size: int,
        max_num_seqs: int,
        min_chunk: int = 16,
        mixed: bool = False,
        decode_row_tokens: int = 1,
        role: str = "null",
        min_decode_rows: int = 1,
    ) -> Buckets:
        """`min_decode_rows`: the smallest decode bucket (batch-invariant steps compute rows in tiles of ROW_TILE,
        so a smaller bucket would save nothing and cost a compile)."""
        # Chunks grow by 4x: each bucket costs a compile at start-up, padding costs only a little compute.
        chunks, size = [], min(min_chunk, chunked_prefill_size)
        while size < chunked_prefill_size:
            chunks.append(size)
            size *= 4
        decode_rows = powers_of_two_up_to(max_num_seqs)
        return Buckets(
            prefill_rows=powers_of_two_up_to(max_prefill_rows),
            prefill_chunks=tuple(chunks) + (chunked_prefill_size,),
            decode_rows=tuple(r for r in decode_rows if r >= min(min_decode_rows, max_num_seqs)),
            mixed=mixed,
            decode_row_tokens=decode_row_tokens,
            role=role,
        )

    @staticmethod
    def for_config(engine_cfg: EngineConfig) -> Buckets:
        """The step buckets an engine configuration asks for (the one place the knobs become buckets)."""
        return Buckets.for_limits(
            engine_cfg.max_prefill_rows,
            engine_cfg.chunked_prefill_size,
            engine_cfg.max_num_seqs,
            mixed=engine_cfg.mixed_steps,
            decode_row_tokens=engine_cfg.draft_tokens + 1,
            role=engine_cfg.disaggregation_mode,
            min_decode_rows=ROW_TILE if engine_cfg.batch_invariant else 1,
        )

    @property
    def mixed_decode_group(self) -> GroupShape:
        """A mixed step's decode group always has every decode row (padding the rest): one mixed shape per prefill
        shape, not one per prefill x decode pair."""
        return GroupShape(max(self.decode_rows), 1)

    def mixed_shape(self, prefill: GroupShape) -> StepShape | None:
        """The mixed step that costs what the pure step `prefill` does: its chunk shortened by the decode rows' tokens
        (a row verifying k drafts carries k + 1), so chunk + those tokens is the pure chunk's (None: the chunk is no
        longer than them, or the pure step has more prefill rows than a mixed step carries, MIXED_PREFILL_ROWS)."""
        decode = self.mixed_decode_group
        tokens = decode.rows * self.decode_row_tokens
        if prefill.chunk <= tokens or prefill.rows != MIXED_PREFILL_ROWS:
            return None
        return StepShape(GroupShape(prefill.rows, prefill.chunk - tokens), decode)

    def shapes(self) -> list[StepShape]:
        """Every step shape, in the order they are compiled: first what one request at a time needs (the smallest
        prefill chunk, a decode of one row), then what widens the usable steps soonest; a disaggregated server's
        role only its own kind."""
        prefill = [GroupShape(r, c) for r in self.prefill_rows for c in self.prefill_chunks]
        rest = [StepShape(decode=GroupShape(r, 1)) for r in self.decode_rows] + [StepShape(prefill=p) for p in prefill]
        if self.mixed:
            rest += [shape for shape in map(self.mixed_shape, prefill) if shape is not None]
        first = self.first_shapes()
        return first + [s for s in rest if s not in first and self.runs(s)]

    @property
    def smallest_decode(self) -> GroupShape:
        return GroupShape(self.decode_rows[0], 1)

    def first_shapes(self) -> list[StepShape]:
        first = [StepShape(prefill=GroupShape(1, self.prefill_chunks[0])), StepShape(decode=self.smallest_decode)]
        return [shape for shape in first if self.runs(shape)]

    def runs(self, shape: StepShape) -> bool:
        """Whether this role runs `shape`: a prefill server never decodes, a decode server never prefills."""
        return not (self.role == "prefill" and shape.decode is not None or self.role == "decode" and shape.prefill)

    def prompt_shapes(self, prompt_len: int) -> list[StepShape]:
        """What one prompt of `prompt_len` tokens needs, alone: its chunk (or the largest) and a decode of one."""
        chunk = next((c for c in self.prefill_chunks if c >= prompt_len), self.prefill_chunks[-1])
        return [StepShape(prefill=GroupShape(1, chunk)), StepShape(decode=self.smallest_decode)]


def step_limits(compiled: set[StepShape], buckets: Buckets) -> StepLimits | None:
    """The limits of the compiled shapes; None until a prefill and a decode shape are both compiled (a disaggregated
    server's role: one of its own kind). Mixed steps are allowed once every compiled prefill shape's mixed counterpart
    is compiled too."""
    prefill = {s.prefill for s in compiled if s.prefill is not None and s.decode is None}
    decode = [s.decode.rows for s in compiled if s.decode is not None and s.prefill is None]
    single_row = [p.chunk for p in prefill if p.rows == 1]
    if buckets.role == "decode" and decode:  # no prompt runs here: every state arrives
        return StepLimits(0, 0, max(decode), decode_row_tokens=buckets.decode_row_tokens)
    if buckets.role == "prefill" and single_row:  # no request decodes here: the slots bound the requests prefilling
        decode = [max(buckets.decode_rows)]
    if not single_row or not decode:
        return None
    tokens = max(single_row)
    rows = max(p.rows for p in prefill if p.chunk >= tokens)
    wanted = [m for m in map(buckets.mixed_shape, prefill) if m is not None]
    mixed = (
        buckets.mixed and buckets.mixed_shape(GroupShape(1, tokens)) is not None and all(m in compiled for m in wanted)
    )
    return StepLimits(
        prefill_tokens=tokens,
        prefill_rows=rows,
        decode_rows=max(decode),
        mixed_decode_rows=buckets.mixed_decode_group.rows if mixed else 0,
        decode_row_tokens=buckets.decode_row_tokens,
    )


class CompileCounter:
    """Counts JAX traces and backend compiles in this process (to prove there are none after warm-up)."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_secs: float, **_: str | int) -> None:
        if event in self.EVENTS:
            self.count += 1


class PendingStep:
    """A dispatched step: its forward is launched; `sample()` launches its sampler (the engine calls it once the
    tokens before this step's are delivered), `result()` waits for its StepOutput (launching the sampler first if
    nobody did)."""

    def __init__(
        self,
        runner: ModelRunner,
        number: int,
        groups: list[StepGroup],
        logits: tuple[jax.Array, ...],
        prompt: tuple[Logprobs | None, ...],
        inputs: tuple[GroupInputs, ...],
        sort: bool = False,
    ):
        self._runner, self._number, self._groups = runner, number, groups
        self._logits, self._prompt, self._inputs, self._sort = logits, prompt, inputs, sort
        self._outputs: tuple[GroupOutput, ...] | None = None

    def sample(self) -> None:
        if self._outputs is not None:
            return
        runner = self._runner
        routes = tuple(group.routes for group in self._inputs)
        tokens, sampled = runner._launch_sampler(self._number, self._groups, self._logits, routes, self._sort)
        for out in tokens:
            out.copy_to_host_async()  # the copy runs while the host prepares the next step
        self._outputs = tuple(GroupOutput(*out) for out in zip(tokens, sampled, self._prompt))

    def result(self) -> StepOutput:
        self.sample()
        assert self._outputs is not None
        fetched = {
            group.decode: _fetch(out, group.rows, inputs.asked)
            for out, group, inputs in zip(self._outputs, self._groups, self._inputs)
        }
        return StepOutput(prefill=fetched.get(False, ()), decode=fetched.get(True, ()))


class PendingVerify:
    """A dispatched verify step (speculative decoding): drafting, verifying and sampling its decode rows are one
    call; a mixed step's prompt rows then sample as a plain step's do (`prompts`, whose sampler `sample()`
    launches). `result()` waits for the tokens."""

    def __init__(self, rows: int, verified: Verified, prompts: PendingStep | None = None):
        self._rows, self._verified, self._prompts = rows, verified, prompts
        for out in (verified.tokens, verified.counts, verified.verified):
            out.copy_to_host_async()

    def sample(self) -> None:
        if self._prompts is not None:
            self._prompts.sample()

    def result(self) -> StepOutput:
        prompts = () if self._prompts is None else self._prompts.result().prefill
        tokens, counts = np.asarray(self._verified.tokens), np.asarray(self._verified.counts)
        drafted = np.asarray(self._verified.verified)
        outputs = []
        for i in range(self._rows):
            kept = [int(t) for t in tokens[i, : counts[i]]]
            # No token: the row's request already had its max_tokens from the step before, which ends it (the
            # engine reads no row of a finished request).
            row = RowOutput(kept[-1], accepted=tuple(kept[:-1]), drafted=int(drafted[i])) if kept else RowOutput.NONE
            outputs.append(row)
        return StepOutput(prefill=prompts, decode=tuple(outputs))


@dataclass
class StepTimes:
    compile_s: dict[StepShape, float] = field(default_factory=dict)


def step_kernels(cfg: ModelConfig, mesh: Mesh, choice: str, batch_invariant: bool) -> Kernels:
    """The kernel table every step of a runner runs through: `--kernels choice` for these devices, with the rows in
    fixed tiles when batch-invariant (`--batch-invariant`, docs/architecture.md), which DeepSeek-V4.1 is not yet."""
    if batch_invariant and cfg.v41:
        raise ConfigError(
            "batch_invariant: DeepSeek-V4.1's shared compressed KV and Engram are not batch-invariant yet; serve it "
            "without --batch-invariant"
        )
    return kernels_for(choice, mesh.devices.flat[0].platform, ROW_TILE if batch_invariant else None)


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        weights,
        geometry: CacheGeometry,
        mesh: Mesh,
        buckets: Buckets,
        kernels: str = "auto",
        batch_invariant: bool = False,
    ):
        self.cfg = cfg
        self.kernels = step_kernels(cfg, mesh, kernels, batch_invariant)
        self.geometry = geometry
        self.mesh = mesh
        self.buckets = buckets
        self.weights = weights
        # Speculative decoding's drafts per step (0: none): the KV cache then travels with the draft state.
        self.draft_tokens = geometry.draft_tokens
        if self.draft_tokens and not (cfg.mtp_layers or cfg.dspark_drafting):
            raise ValueError("speculative decoding drafts with an MTP block or a DSpark drafter; the weights hold none")
        # Every step shape's executables, compiled once.
        self.executable_cache = ExecutableCache(cfg, weights, geometry, mesh, self.kernels)
        self._replicated = self.executable_cache.replicated
        # A sequence's state copied out of the cache or into it (disaggregated serving).
        self.mover = StateMover(
            self.executable_cache.abstract_cache,
            self.executable_cache.cache_shardings,
            mesh,
            geometry.num_pages,
            powers_of_two_up_to(geometry.max_pages_per_seq),
        )
        self.cache: Any  # the device state every step threads through (donated), and each slot's next input token
        self.slot_tokens: jax.Array
        self._init_cache()
        self._penalties_warmed: set[int] = set()  # group sizes whose first penalty bucket is compiled
        self._warmed: set[StepShape] = set()  # the shapes warmed up for the engine's steps (limits() reads these)
        self._everything_allowed: dict[int, jax.Array] = {}  # rows -> an all-ones token mask on the device
        # limits() of the first _limits_for compiled shapes
        self._limits: StepLimits | None = None
        self._limits_for = 0
        self._launching = threading.Lock()
        self.times = StepTimes()
        # Multi-controller serving (jaxserve.runner.mirror): on process 0, the log its device calls go into for the
        # other processes; on the others, each replayed forward's logits and routes until its sampler call.
        self.mirror: CallLog | None = None
        self._next_forward = 0  # forwards launched so far, each process counting its own
        self._replayed: dict[int, tuple[tuple[jax.Array, ...], tuple[TokenRoutes, ...]]] = {}

    @property
    def compile_sync(self) -> CompileSync | None:
        """In a group: no shape runs before every process compiled it (set by the CLI)."""
        return self.executable_cache.compile_sync

    @compile_sync.setter
    def compile_sync(self, sync: CompileSync | None) -> None:
        self.executable_cache.compile_sync = sync

    # ---- compilation -------------------------------------------------------------------------------------------
    def compile_ahead(self, stop: Callable[[], bool] | None = None) -> None:
        """Compile every bucket's shape in the order process 0 does, without running any (a follower's: its steps
        come from process 0, which warms each shape up; `replay` compiles a shape it meets first itself)."""
        for shape in self.buckets.shapes():
            if stop is not None and stop():
                return
            self.executable_cache.get(shape)

    def compile(self, shape: StepShape) -> list[list[jax.stages.Compiled]]:
        """`shape` compiled now, as the engine compiles it (ExecutableCache.compile)."""
        return self.executable_cache.compile(shape)

    def warmup(
        self,
        shapes: Sequence[StepShape] | None = None,
        show_progress: bool = False,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Compile `shapes` (default: every bucket), skipping those already compiled, in order; `stop()` is asked
        between shapes. Steps use only compiled shapes (limits()), so serving can start before all are done."""
        todo = [s for s in (self.buckets.shapes() if shapes is None else shapes) if s not in self._warmed]
        started = time.perf_counter()
        for i, shape in enumerate(todo, start=1):
            if stop is not None and stop():
                return
            t0 = time.perf_counter()
            self.executable_cache.get(shape)
            if self.compile_sync is not None:
                self.compile_sync.wait_compiled(shape.key)
            # Run it once on padding rows (length 0: they write nothing), so the executable's first-call set-up
            # happens now rather than as a latency spike in the middle of serving.
            padding = padding_groups(shape)
            self._launch(shape, padding).result()
            # and the sampler that sorts, for a batch with a top-k / top-p row
            if not self.executable_cache.verifies(shape):
                self._launch(shape, padding, sort=True).result()
            for group, _ in shape.groups:  # and the penalties' first bucket for its groups
                self._warm_penalties(group.rows)
            self._warmed.add(shape)  # now the engine may use it (a set insert is atomic)
            elapsed = time.perf_counter() - t0
            self.times.compile_s[shape] = elapsed
            described = str(shape)
            log.debug("compiled %s in %.2f s (%d/%d)", described, elapsed, i, len(todo))
            if show_progress:
                so_far = time.perf_counter() - started
                progress(
                    "compiling step shapes",
                    i,
                    len(todo),
                    started,
                    detail=f"(about {so_far / i * (len(todo) - i):.0f} s to go; last: {described})",
                )

    def _warm_penalties(self, rows: int) -> None:
        if rows in self._penalties_warmed:
            return
        logits = jnp.zeros((rows, self.cfg.vocab_size), jnp.float32, device=self._replicated)
        jax.block_until_ready(self.executable_cache.penalize(logits, PenaltyArrays.neutral(rows, PENALTY_BUCKET)))
        self._penalties_warmed.add(rows)

    def limits(self) -> StepLimits | None:
        """What steps the compiled shapes allow (None: not even one prefill and one decode shape yet)."""
        compiled = set(self._warmed)
        if len(compiled) != self._limits_for:
            self._limits, self._limits_for = step_limits(compiled, self.buckets), len(compiled)
        return self._limits

    def cache_lost(self) -> bool:
        """True when a failed call consumed the donated cache."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves((self.cache, self.slot_tokens)))

    def reset_cache(self) -> None:
        if self.mirror is not None:
            with self._launching:
                self.mirror.add(ResetCall())
        self._init_cache()

    # ---- disaggregated serving ---------------------------------------------------------------------------------
    def export_state(self, pages: list[int], slot: int) -> Parcel:
        """A sequence's state at `pages` and `slot`, copied out of the cache as of the steps dispatched so far."""
        with self._launching:
            self._single_process("a hand-off")
            return self.mover.export(self.cache, pages, slot)

    def install_state(self, parcel: Parcel, pages: list[int], slot: int, token: int) -> None:
        """Write a parcel's state into `pages` and `slot` (the cache donated), `token` its next input token."""
        with self._launching:
            self._single_process("an arrival")
            self.cache, self.slot_tokens = self.mover.install(self.cache, self.slot_tokens, parcel, pages, slot, token)

    def warm_transfers(self, export: bool, install: bool) -> None:
        """Compile the state's cuts for every page bucket (a prefill server's export, a decode server's install and
        checksums), so no request waits for a compile."""
        with self._launching:
            self.cache, self.slot_tokens = self.mover.warm(self.cache, self.slot_tokens, export, install)

    def _single_process(self, what: str) -> None:
        if self.mirror is not None:
            raise RuntimeError(f"{what} is a call the group's other processes would not replay")

    def _init_cache(self) -> None:
        with jax.set_mesh(self.mesh):
            executables = self.executable_cache
            self.cache = zeros_of(executables.abstract_cache, executables.cache_shardings)
            self.slot_tokens = jnp.zeros(self.geometry.num_slots, jnp.int32, device=self._replicated)

    # ---- stepping ----------------------------------------------------------------------------------------------
    def run(self, batch: StepBatch) -> StepOutput:
        """One step, waited for: the token sampled after each row and the logprobs its row asked for."""
        return self.dispatch(batch).result()

    def dispatch(self, batch: StepBatch) -> PendingStep | PendingVerify:
        """Start one step without waiting for it. Every row samples (after a chunk that is not its prompt's last,
        the token is neither kept nor returned as an output)."""
        groups = self._groups(batch)
        return self._launch(self._usable_shape(groups), groups)

    def executables(self, shape: StepShape) -> list[jax.stages.Compiled]:
        """A compiled step shape's executables, for static profiles and benchmarks: its forward, then the samplers it
        may run (the one that does not sort for top-k / top-p, then the one that does); a verify step's: the whole
        step, then its all-greedy variant. KeyError for a shape not warmed up yet."""
        if shape not in self._warmed:
            raise KeyError(shape)
        return self.executable_cache.executables(shape)

    def device_seconds(self, batch: StepBatch, repeats: int, back_to_back: int = 1) -> list[float]:
        """Seconds per call of the compiled step of `batch` on inputs built once, `repeats` times: the step's time
        without the host's share (building inputs, scheduling, delivery). Each time is `back_to_back` calls made
        before waiting for the last, over their number: with one, the call's latency (its launch included); with
        more, the device's pace when it is never left waiting, as in the overlapped loop. For benchmarks: it
        rewrites the batch's KV positions with the same values."""
        if self.mirror is not None:
            raise RuntimeError("device_seconds times one process's calls; the other processes would not join them")
        groups = self._groups(batch)
        shape = self._usable_shape(groups)
        if self.executable_cache.verifies(shape):
            raise RuntimeError("device_seconds times plain steps; a verify step's tokens depend on its drafts")
        compiled = self.executable_cache.get(shape)
        inputs = self._host_inputs(groups)
        routes = tuple(group.routes for group in inputs)
        samplings = self._sampling_arrays(groups, [late.masks for late in self._late_inputs(groups)])
        sampler = self._sampler_for(tuple(group.shape.rows for group in groups), samplings)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(back_to_back):
                logits, _, self.cache = compiled.forward(
                    weights=self.weights, cache=self.cache, slot_tokens=self.slot_tokens, groups=inputs
                )
                outputs = sampler(
                    slot_tokens=self.slot_tokens, logits=logits, penalized=logits, samplings=samplings, routes=routes
                )
                self.slot_tokens = outputs[2]
            jax.block_until_ready(outputs)
            times.append((time.perf_counter() - started) / back_to_back)
        return times

    def _groups(self, batch: StepBatch) -> list[StepGroup]:
        """The batch's groups of rows, each with the compiled shape it runs in."""
        groups = []
        if (prefill := batch.prefill) is not None:
            groups.append(StepGroup(prefill, self._prefill_shape(prefill.num_rows, prefill.longest, batch.mixed)))
        if (decode := batch.decode) is not None:
            shape = self.buckets.mixed_decode_group if batch.mixed else self._decode_shape(decode.num_rows)
            if decode.num_rows > shape.rows:
                raise ValueError(f"decode batch {decode.num_rows} exceeds the largest compiled bucket {shape.rows}")
            groups.append(StepGroup(decode, shape))
        return groups

    def _prefill_shape(self, rows: int, tokens: int, mixed: bool) -> GroupShape:
        """The cheapest compiled prefill group that holds `rows` chunks of up to `tokens` tokens."""
        kind = StepKind.MIXED if mixed else StepKind.PREFILL
        shapes = [s.prefill for s in list(self._warmed) if s.kind is kind and s.prefill is not None]
        fits = [(p.rows * p.chunk, p) for p in shapes if p.rows >= rows and p.chunk >= tokens]
        if not fits:
            raise ValueError(
                f"{rows} prefill rows of up to {tokens} tokens: no compiled {kind.value} step holds "
                f"them (the largest compiled one is {max(shapes, default=None)})"
            )
        return min(fits)[1]

    def _decode_shape(self, rows: int) -> GroupShape:
        sizes = [s.decode.rows for s in list(self._warmed) if s.kind is StepKind.DECODE and s.decode is not None]
        return GroupShape(min((d for d in sizes if d >= rows), default=max(sizes, default=0)), 1)

    def _usable_shape(self, groups: list[StepGroup]) -> StepShape:
        shape = StepShape(**{"decode" if group.decode else "prefill": group.shape for group in groups})
        if shape not in self._warmed:
            raise RuntimeError(f"step shape {shape} was not compiled; call warmup() first")
        return shape

    def _launch(self, shape: StepShape, groups: list[StepGroup], sort: bool = False) -> PendingStep | PendingVerify:
        """`sort`: the warm-up's padding rows sample through the sampler that sorts (see _launch_sampler)."""
        if self.executable_cache.verifies(shape):
            return self._launch_verify(shape, groups, sort)
        inputs = self._host_inputs(groups)
        number, logits, prompt = self._run_forward(shape, inputs)
        return PendingStep(self, number, groups, logits, prompt, inputs, sort)

    def _launch_verify(self, shape: StepShape, groups: list[StepGroup], sort: bool = False) -> PendingVerify:
        (group,) = [g for g in groups if g.decode]
        prompt_groups = [g for g in groups if not g.decode]  # a mixed step's prompt chunks
        inputs = verify_inputs(group, self.geometry)
        prompts = self._host_inputs(prompt_groups)
        (params,) = self._sampling_arrays([group])
        executables = self.executable_cache.get(shape)
        all_greedy = all(p.temperature == 0 for p in group.rows.params)
        step = executables.greedy if all_greedy and executables.greedy is not None else executables.forward
        with self._launching:
            number, self._next_forward = self._next_forward, self._next_forward + 1
            verified, logits, prompt, self.cache, self.slot_tokens = step(
                weights=self.weights,
                cache=self.cache,
                slot_tokens=self.slot_tokens,
                inputs=inputs,
                params=params,
                prompts=prompts,
            )
        sampling = PendingStep(self, number, prompt_groups, logits, prompt, prompts, sort) if prompts else None
        return PendingVerify(group.rows.num_rows, verified, sampling)

    def _run_forward(self, shape: StepShape, inputs: tuple[GroupInputs, ...]):
        executables = self.executable_cache.get(shape)
        # The cache and the slot tokens are replaced: the warm-up's padding runs (on the compiling thread) and the
        # engine's steps must take turns (dispatch is asynchronous, so the lock is held only while a call is queued).
        # The mirror logs each call inside the lock, so the other processes replay the launch order.
        with self._launching:
            number, self._next_forward = self._next_forward, self._next_forward + 1
            if self.mirror is not None:
                self.mirror.add(ForwardCall(number, shape, inputs))
            logits, prompt, self.cache = executables.forward(
                weights=self.weights, cache=self.cache, slot_tokens=self.slot_tokens, groups=inputs
            )
        return number, logits, prompt

    def _launch_sampler(self, number: int, groups: list[StepGroup], logits, routes, sort: bool = False):
        # Asks the rows' late inputs (grammar masks, penalties' token counts): after the tokens before these landed.
        late = self._late_inputs(groups)
        samplings = self._sampling_arrays(groups, [inputs.masks for inputs in late])
        if sort:  # padding rows (their tokens are dropped) given a top-k, so the sorting sampler runs, here and
            # in every process that replays the call
            # (a host array, as for_group makes them: hence Any)
            top_ks: Any = [np.ones_like(s.top_k) for s in samplings]
            samplings = tuple(dataclasses.replace(s, top_k=top_k) for s, top_k in zip(samplings, top_ks))
        penalties = tuple(PenaltyArrays.for_group(g.rows, inputs, g.shape.rows) for g, inputs in zip(groups, late))
        return self._run_sampler(number, logits, routes, samplings, penalties)

    def _run_sampler(self, number: int, logits, routes, samplings: tuple[SamplingArrays, ...], penalties):
        sampler = self._sampler_for(tuple(group_logits.shape[0] for group_logits in logits), samplings)
        with self._launching:
            if self.mirror is not None:
                # A group that allows every token sends no mask (None): each process keeps that one on its devices.
                kept = tuple(s.allowed is self._everything_allowed.get(s.allowed.shape[0]) for s in samplings)
                nothing: Any = None
                sent = tuple(dataclasses.replace(s, allowed=nothing) if k else s for s, k in zip(samplings, kept))
                self.mirror.add(SampleCall(number, sent, penalties))
            penalized = tuple(
                group_logits if p is None else self.executable_cache.penalize(group_logits, p)
                for group_logits, p in zip(logits, penalties)
            )
            tokens, sampled, self.slot_tokens = sampler(
                slot_tokens=self.slot_tokens, logits=logits, penalized=penalized, samplings=samplings, routes=routes
            )
        return tokens, sampled

    def _sampler_for(self, rows: tuple[int, ...], samplings: tuple[SamplingArrays, ...]) -> jax.stages.Compiled:
        """The compiled sampler of groups of `rows`: the one that sorts only when some row cuts by top-k / top-p."""
        return self.executable_cache.sampler(rows, any(s.cuts() for s in samplings))

    def replay(self, call: Call) -> None:
        """Run process 0's `call` on this process's devices (a follower's; jaxserve.runner.mirror)."""
        if isinstance(call, ForwardCall):
            if call.number != self._next_forward:  # checked before the call: it would consume the cache
                raise RuntimeError(
                    f"process 0's forward {call.number} replayed as this process's forward {self._next_forward}: "
                    "out of step"
                )
            number, logits, _ = self._run_forward(call.shape, call.groups)
            self._replayed[number] = (logits, tuple(group.routes for group in call.groups))
        elif isinstance(call, SampleCall):
            logits, routes = self._replayed.pop(call.number)
            for stale in [n for n in self._replayed if n < call.number]:  # forwards whose sampler never launched
                del self._replayed[stale]
            samplings = tuple(
                dataclasses.replace(s, allowed=self._all_tokens_allowed(s.temperature.shape[0]))
                if s.allowed is None
                else s
                for s in call.samplings
            )
            self._run_sampler(call.number, logits, routes, samplings, call.penalties)
        elif isinstance(call, ResetCall):
            self._init_cache()
        else:
            raise TypeError(f"not a call to replay: {call!r}")

    def _sampling_arrays(
        self, groups: list[StepGroup], masks: Sequence[np.ndarray | None] | None = None
    ) -> tuple[SamplingArrays, ...]:
        """Each group's sampling arrays; `masks`: its late token masks (None: every token allowed, by a mask kept on
        the device, so no mask is copied there)."""
        masks = masks or [None] * len(groups)
        return tuple(
            SamplingArrays.for_group(group.rows, group.shape.rows, self._all_tokens_allowed(group.shape.rows), mask)
            for group, mask in zip(groups, masks)
        )

    def _late_inputs(self, groups: list[StepGroup]) -> list[LateInputs]:
        """Each group's late inputs (GroupBatch.late), asked once its step's sampler is about to launch."""
        return [group.rows.late(self.executable_cache.mask_shape(group.shape.rows)[1]) for group in groups]

    def _all_tokens_allowed(self, rows: int) -> jax.Array:
        mask = self._everything_allowed.get(rows)
        if mask is None:
            mask = jnp.full(self.executable_cache.mask_shape(rows), -1, jnp.int32, device=self._replicated)
            self._everything_allowed[rows] = mask
        return mask

    def _host_inputs(self, groups: list[StepGroup]) -> tuple[GroupInputs, ...]:
        return tuple(group_inputs(group, self.geometry) for group in groups)


def _fetch(out: GroupOutput, rows: GroupBatch, asked: LogprobInputs) -> tuple[RowOutput, ...]:
    """One group's outputs on the host, row by row; logprobs are copied from the device only for rows that asked."""
    n = rows.num_rows
    tokens = np.asarray(out.tokens)[:n]
    sampled: list[TokenLogprob | None] = [None] * n
    prompt: list[list[TokenLogprob] | None] = [None] * n
    if asked.sampled.any():
        values = jax.device_get(out.sampled)
        for i in np.flatnonzero(rows.logprobs >= 0):
            sampled[i] = to_host(
                tokens[i : i + 1],
                values.token[i : i + 1],
                values.top_ids[i : i + 1],
                values.top[i : i + 1],
                int(rows.logprobs[i]),
            )[0]
    if asked.prompt is not None and asked.prompt.any():
        values = jax.device_get(out.prompt)
        for i in np.flatnonzero((rows.prompt_logprobs >= 0) & (rows.next_counts > 0)):
            m = int(rows.next_counts[i])
            targets = rows.next_tokens[i, :m]
            prompt[i] = to_host(
                targets, values.token[i, :m], values.top_ids[i, :m], values.top[i, :m], int(rows.prompt_logprobs[i])
            )
    return tuple(
        RowOutput(int(token), logprob, prompt_logprobs)
        for token, logprob, prompt_logprobs in zip(tokens, sampled, prompt)
    )


def build_runner(engine_cfg: EngineConfig, model_cfg: ModelConfig, weights, mesh: Mesh) -> ModelRunner:
    """The runner (KV geometry and step buckets) these knobs ask for."""
    return ModelRunner(
        model_cfg,
        weights,
        kv_geometry(engine_cfg, model_cfg),
        mesh,
        Buckets.for_config(engine_cfg),
        kernels=engine_cfg.kernels,
        batch_invariant=engine_cfg.batch_invariant,
    )
