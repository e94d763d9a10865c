"""The device side: two jitted steps, *prefill a chunk* and *decode one step*, over weights on a mesh.

A step is two calls, launched one after the other: the forward, `(weights, cache, slot tokens, inputs, routes,
logprob inputs) -> (logits at each row's last token, prompt logprobs, cache)` with the cache donated, and the
sampler, `(slot tokens, logits, sampling, routes) -> (tokens, their logprobs, slot tokens)` (see
jaxserve.runner.logprobs for what logprobs leave the device). Both are compiled ahead of time for a small set of
shape buckets (rows x chunk length for prefill, rows for decode; the sampler by rows). A call whose shape is not a
bucket is an error, never a silent recompile.

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.kernels.table import kernels_for
from jaxserve.model.cache import CacheGeometry, kv_geometry, zeros_of
from jaxserve.model.forward import final_norm, hidden_streams, last_logits
from jaxserve.model.inputs import StepInputs
from jaxserve.model.sharding import shardings_for
from jaxserve.progress import progress
from jaxserve.request import TokenLogprob
from jaxserve.request.grammar import mask_words
from jaxserve.request.step import (
    MIXED_PREFILL_ROWS,
    GroupShape,
    RowOutput,
    StepKind,
    StepLimits,
    StepOutput,
    StepPlan,
    StepRow,
    StepShape,
)
from jaxserve.runner.logprobs import LogprobInputs, Logprobs, prompt_logprobs, sampled_logprobs, to_host
from jaxserve.runner.mirror import Call, CallLog, CompileSync, ForwardCall, ResetCall, SampleCall
from jaxserve.runner.sampling import PENALTY_BUCKET, PenaltyArrays, SamplingArrays, apply_penalties, sample
from jaxserve.runner.speculative import (
    DraftInputs,
    SpeculativeCache,
    Verified,
    abstract_runner_cache,
    prefill_drafts,
    speculative_step,
)

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

    @staticmethod
    def for_limits(
        max_prefill_rows: int, chunked_prefill_size: int, max_num_seqs: int, min_chunk: int = 16, mixed: bool = False
    ) -> Buckets:
        # Chunks grow by 4x: each bucket costs a compile at start-up, padding costs only a little compute.
        chunks, size = [], min(min_chunk, chunked_prefill_size)
        while size < chunked_prefill_size:
            chunks.append(size)
            size *= 4
        return Buckets(
            prefill_rows=powers_of_two_up_to(max_prefill_rows),
            prefill_chunks=tuple(chunks) + (chunked_prefill_size,),
            decode_rows=powers_of_two_up_to(max_num_seqs),
            mixed=mixed,
        )

    @staticmethod
    def for_config(engine_cfg: EngineConfig) -> Buckets:
        """The step buckets an engine configuration asks for (the one place the knobs become buckets)."""
        return Buckets.for_limits(
            engine_cfg.max_prefill_rows,
            engine_cfg.chunked_prefill_size,
            engine_cfg.max_num_seqs,
            mixed=engine_cfg.mixed_steps,
        )

    @property
    def mixed_decode_group(self) -> GroupShape:
        """A mixed step's decode group always has every decode row (padding the rest): one mixed shape per prefill
        shape, not one per prefill x decode pair."""
        return GroupShape(max(self.decode_rows), 1)

    def mixed_shape(self, prefill: GroupShape) -> StepShape | None:
        """The mixed step that costs what the pure step `prefill` does: its chunk shortened by the decode rows, so
        chunk + decode rows is the pure chunk's tokens (None: the chunk is no longer than the decode rows, or the pure
        step has more prefill rows than a mixed step carries, MIXED_PREFILL_ROWS)."""
        decode = self.mixed_decode_group
        if prefill.chunk <= decode.rows or prefill.rows != MIXED_PREFILL_ROWS:
            return None
        return StepShape(GroupShape(prefill.rows, prefill.chunk - decode.rows), decode)

    def shapes(self) -> list[StepShape]:
        """Every step shape, in the order they are compiled: first what one request at a time needs (the smallest
        prefill chunk, a decode of one row), then what widens the usable steps soonest."""
        prefill = [GroupShape(r, c) for r in self.prefill_rows for c in self.prefill_chunks]
        first = [StepShape(prefill=GroupShape(1, self.prefill_chunks[0])), StepShape(decode=GroupShape(1, 1))]
        rest = [StepShape(decode=GroupShape(r, 1)) for r in self.decode_rows] + [StepShape(prefill=p) for p in prefill]
        if self.mixed:
            rest += [shape for shape in map(self.mixed_shape, prefill) if shape is not None]
        return first + [s for s in rest if s not in first]

    def first_shapes(self) -> list[StepShape]:
        return self.shapes()[:2]

    def prompt_shapes(self, prompt_len: int) -> list[StepShape]:
        """What one prompt of `prompt_len` tokens needs, alone: its chunk (or the largest) and a decode of one."""
        chunk = next((c for c in self.prefill_chunks if c >= prompt_len), self.prefill_chunks[-1])
        return [StepShape(prefill=GroupShape(1, chunk)), StepShape(decode=GroupShape(1, 1))]


def step_limits(compiled: set[StepShape], buckets: Buckets) -> StepLimits | None:
    """The limits of the compiled shapes; None until a prefill and a decode shape are both compiled. Mixed steps
    are allowed once every compiled prefill shape's mixed counterpart is compiled too."""
    prefill = {s.prefill for s in compiled if s.prefill is not None and s.decode is None}
    decode = [s.decode.rows for s in compiled if s.decode is not None and s.prefill is None]
    single_row = [p.chunk for p in prefill if p.rows == 1]
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


@jax.tree_util.register_dataclass
@dataclass
class TokenRoutes:
    """Where each row's tokens come from and where its sampled token goes, on the device."""

    feed_from_slot: jax.Array  # [b] bool: the row's input is the token its slot sampled last (decode rows)
    store_slot: jax.Array  # [b] int32: the slot that keeps the sampled token; num_slots: not kept (dropped)


@dataclass(frozen=True)
class _Group:
    """One group of a step's rows and the compiled shape they run in (decode: the decode group)."""

    rows: tuple[StepRow, ...]
    shape: GroupShape
    decode: bool


@dataclass(frozen=True)
class _Executables:
    """One step shape's compiled forward (its samplers are kept by their groups' rows: ModelRunner._samplers)."""

    forward: jax.stages.Compiled  # a verify step's whole step with drafting on (it samples inside)
    # A verify step's variant for batches whose every row is greedy: no sampling filter, only argmaxes.
    greedy: jax.stages.Compiled | None = None


class PendingStep:
    """A dispatched step: its forward is launched; `sample()` launches its sampler (the engine calls it once the
    tokens before this step's are delivered), `result()` waits for its StepOutput (launching the sampler first if
    nobody did)."""

    def __init__(
        self,
        runner: ModelRunner,
        number: int,
        groups: list[_Group],
        logits: tuple[jax.Array, ...],
        prompt: tuple[Logprobs | None, ...],
        routes: tuple[TokenRoutes, ...],
        asked: tuple[LogprobInputs, ...],
        sort: bool = False,
    ):
        self._runner, self._number, self._groups = runner, number, groups
        self._logits, self._prompt, self._routes, self._asked = logits, prompt, routes, asked
        self._sort = sort
        self._outputs: tuple[GroupOutput, ...] | None = None

    def sample(self) -> None:
        if self._outputs is not None:
            return
        runner = self._runner
        tokens, sampled = runner._launch_sampler(self._number, self._groups, self._logits, self._routes, self._sort)
        for out in tokens:
            out.copy_to_host_async()  # the copy runs while the host prepares the next step
        self._outputs = tuple(GroupOutput(*out) for out in zip(tokens, sampled, self._prompt))

    def result(self) -> StepOutput:
        self.sample()
        assert self._outputs is not None
        fetched = {
            group.decode: _fetch(out, group.rows, asked)
            for out, group, asked in zip(self._outputs, self._groups, self._asked)
        }
        return StepOutput(prefill=fetched.get(False, ()), decode=fetched.get(True, ()))


class PendingVerify:
    """A dispatched verify step (speculative decoding): drafting, verifying and sampling are one call, so there is
    no sampler to launch; `result()` waits for its tokens."""

    def __init__(self, rows: tuple[StepRow, ...], verified: Verified):
        self._rows, self._verified = rows, verified
        verified.tokens.copy_to_host_async()

    def sample(self) -> None:
        pass

    def result(self) -> StepOutput:
        tokens, counts = np.asarray(self._verified.tokens), np.asarray(self._verified.counts)
        outputs = []
        for i in range(len(self._rows)):
            kept = [int(t) for t in tokens[i, : counts[i]]]
            outputs.append(RowOutput(kept[-1], accepted=tuple(kept[:-1])))
        return StepOutput(prefill=(), decode=tuple(outputs))


@dataclass
class StepTimes:
    compile_s: dict[StepShape, float] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self, cfg: ModelConfig, weights, geometry: CacheGeometry, mesh: Mesh, buckets: Buckets, kernels: str = "auto"
    ):
        self.cfg = cfg
        # The kernel table's choice for these devices (--kernels); every step runs through it.
        self.kernels = kernels_for(kernels, mesh.devices.flat[0].platform)
        self.geometry = geometry
        self.mesh = mesh
        self.buckets = buckets
        self.weights = weights
        # Speculative decoding's drafts per step (0: none): the KV cache then travels with the draft state.
        self.draft_tokens = geometry.draft_tokens
        if self.draft_tokens and not cfg.mtp_layers:
            raise ValueError("speculative decoding drafts with the model's MTP block, but the weights hold none")
        self._abstract_cache: Any = abstract_runner_cache(cfg, geometry)
        self._cache_shardings = shardings_for(self._abstract_cache, mesh)
        self._weight_shardings = jax.tree.map(lambda x: x.sharding, weights)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._init_cache()
        self._forward = jax.jit(
            self._forward_fn,
            donate_argnames=("cache",),
            out_shardings=(self._replicated, self._replicated, self._cache_shardings),
        )
        self._sampler = jax.jit(self._sampler_fn, static_argnames=("cuts",), out_shardings=self._replicated)
        self._speculate = jax.jit(
            self._speculate_fn,
            static_argnames=("sampled",),
            donate_argnames=("cache",),
            out_shardings=(self._replicated, self._cache_shardings, self._replicated),
        )
        # Only groups with a penalized row take it (compiled once per penalty bucket reached, when first needed).
        self._penalize = jax.jit(apply_penalties, out_shardings=self._replicated)
        self._penalties_warmed: set[int] = set()  # group sizes whose first penalty bucket is compiled
        # Every compiled shape, and those warmed up for the engine's steps (limits() reads only these).
        self._executables: dict[StepShape, _Executables] = {}
        self._compiled: dict[StepShape, _Executables] = {}
        self._compiling = threading.Lock()
        # By the rows of each group and whether some row cuts by top-k / top-p (the sampler that sorts).
        self._samplers: dict[tuple[tuple[int, ...], bool], jax.stages.Compiled] = {}
        self._everything_allowed: dict[int, jax.Array] = {}  # rows -> an all-ones token mask on the device
        # limits() of the first _limits_for compiled shapes
        self._limits: StepLimits | None = None
        self._limits_for = 0
        self._launching = threading.Lock()
        self.times = StepTimes()
        # Multi-controller serving (jaxserve.runner.mirror): on process 0, the log its device calls go into for the
        # other processes; on the others, each replayed forward's logits and routes until its sampler call.
        self.mirror: CallLog | None = None
        self.compile_sync: CompileSync | None = None  # in a group: no shape runs before every process compiled it
        self._next_forward = 0  # forwards launched so far, each process counting its own
        self._replayed: dict[int, tuple[tuple[jax.Array, ...], tuple[TokenRoutes, ...]]] = {}

    def _forward_fn(
        self,
        weights,
        cache,
        slot_tokens: jax.Array,
        groups: tuple[StepInputs, ...],
        routes: tuple[TokenRoutes, ...],
        logprob_inputs: tuple[LogprobInputs, ...],
        draft_inputs: tuple[DraftInputs | None, ...],
    ):
        groups = tuple(
            dataclasses.replace(g, tokens=jnp.where(r.feed_from_slot[:, None], slot_tokens[g.slots][:, None], g.tokens))
            for g, r in zip(groups, routes)
        )
        speculative = isinstance(cache, SpeculativeCache)
        hs, kv = hidden_streams(weights, cache.kv if speculative else cache, groups, self.cfg, self.kernels)
        if speculative:
            draft = cache.draft
            for h, inputs, route, drafting in zip(hs, groups, routes, draft_inputs):
                if drafting is not None:  # prefill groups: the MTP block reads the chunk too
                    completes = route.store_slot < self.geometry.num_slots
                    draft = prefill_drafts(weights, draft, h, inputs, drafting, completes, self.cfg, self.kernels)
            cache = SpeculativeCache(kv, draft)
        else:
            cache = kv
        ys = [
            final_norm(h, weights.hc_head_fn, weights.hc_head_base, weights.hc_head_scale, weights.norm, self.cfg)
            for h in hs
        ]
        logits, prompts = [], []
        for y, inputs, asked in zip(ys, groups, logprob_inputs):
            logits.append(last_logits(y, inputs, weights.head, self.cfg.vocab_size))
            prompt = None
            if asked.targets is not None and asked.prompt is not None:  # prefill groups only (_logprob_inputs)
                prompt = prompt_logprobs(y, weights.head, asked.targets, asked.prompt, self.cfg.vocab_size)
            prompts.append(prompt)
        return tuple(logits), tuple(prompts), cache

    def _speculate_fn(
        self,
        weights,
        cache: SpeculativeCache,
        slot_tokens: jax.Array,
        inputs: StepInputs,
        params: SamplingArrays,
        sampled: bool = True,
    ):
        verified, kv, draft, slot_tokens = speculative_step(
            weights,
            cache.kv,
            cache.draft,
            slot_tokens,
            inputs,
            params,
            self.draft_tokens,
            self.cfg,
            self.kernels,
            sampled,
        )
        return verified, SpeculativeCache(kv, draft), slot_tokens

    @staticmethod
    def _sampler_fn(
        slot_tokens: jax.Array,
        logits: tuple[jax.Array, ...],
        penalized: tuple[jax.Array, ...],
        samplings: tuple[SamplingArrays, ...],
        routes: tuple[TokenRoutes, ...],
        cuts: bool,
    ):
        """Samples from `penalized` (a group's logits after its penalties, or the logits themselves); the logprobs
        are the raw `logits`'. `cuts`: some row has a top-k or top-p cut (see `sample`)."""
        tokens, sampled = [], []
        for group_logits, to_sample, sampling, route in zip(logits, penalized, samplings, routes):
            group_tokens = sample(to_sample, sampling, cuts)
            slot_tokens = slot_tokens.at[route.store_slot].set(group_tokens, mode="drop")
            tokens.append(group_tokens)
            sampled.append(sampled_logprobs(group_logits, group_tokens))
        return tuple(tokens), tuple(sampled), slot_tokens

    # ---- compilation -------------------------------------------------------------------------------------------
    def _abstract(self, shape, dtype) -> Any:  # stands in for a jax.Array in the abstract inputs
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

    def _abstract_group(
        self, rows: int, chunk: int, decode: bool
    ) -> tuple[StepInputs, TokenRoutes, LogprobInputs, DraftInputs | None]:
        arr = self._abstract
        inputs = StepInputs(
            tokens=arr((rows, chunk), jnp.int32),
            positions=arr((rows,), jnp.int32),
            lengths=arr((rows,), jnp.int32),
            slots=arr((rows,), jnp.int32),
            page_table=arr((rows, self.geometry.max_pages_per_seq), jnp.int32),
            **({} if decode else self._abstract_prefix_state(rows, 1)),
        )
        routes = TokenRoutes(feed_from_slot=arr((rows,), jnp.bool_), store_slot=arr((rows,), jnp.int32))
        asked = _logprob_inputs(rows, chunk, arr)
        drafting = (
            None
            if decode or not self.draft_tokens
            else DraftInputs(arr((rows, chunk), jnp.int32), arr((rows,), jnp.int32))
        )
        return inputs, routes, asked, drafting

    def _abstract_verify_args(self, rows: int) -> tuple:
        arr = self._abstract
        inputs = StepInputs(
            tokens=arr((rows, self.draft_tokens + 1), jnp.int32),
            positions=arr((rows,), jnp.int32),
            lengths=arr((rows,), jnp.int32),
            slots=arr((rows,), jnp.int32),
            page_table=arr((rows, self.geometry.max_pages_per_seq), jnp.int32),
            **self._abstract_prefix_state(rows, self.draft_tokens),
        )
        weights, cache = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), (self.weights, self.cache)
        )
        slot_tokens = self._abstract(self.slot_tokens.shape, self.slot_tokens.dtype)
        return weights, cache, slot_tokens, inputs, self._abstract_sampling(rows)

    def _abstract_prefix_state(self, rows: int, snapshots: int) -> dict[str, Any]:
        """A prefill or verify group's state rows (PREFIX_STATE_INPUTS): `snapshots` per row."""
        arr = self._abstract
        return dict(
            read_rows=arr((rows,), jnp.int32),
            snapshot_rows=arr((rows, snapshots), jnp.int32),
            snapshot_lengths=arr((rows, snapshots), jnp.int32),
        )

    def _abstract_sampling(self, rows: int) -> SamplingArrays:
        # The arrays of a group of padding rows, so their fields and shapes are defined in one place (sampling.py).
        padding = SamplingArrays.for_rows((), rows, self._all_tokens_allowed(rows))
        return jax.tree.map(lambda x: self._abstract(x.shape, x.dtype), padding)

    def _abstract_forward_args(self, shape: StepShape) -> tuple:
        groups = [self._abstract_group(group.rows, group.chunk, decode) for group, decode in shape.groups]
        weights, cache, slot_tokens = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            (self.weights, self.cache, self.slot_tokens),
        )
        return (weights, cache, slot_tokens, *(tuple(g[i] for g in groups) for i in range(4)))

    def _abstract_sampler_args(self, shape: StepShape, cuts: bool = True) -> tuple:
        """The sampler's arguments for `shape`'s groups; `cuts` (static): the sampler that sorts, by default (the
        one that needs more memory)."""
        rows = shape.group_rows
        slot_tokens = self._abstract(self.slot_tokens.shape, self.slot_tokens.dtype)
        logits = tuple(self._abstract((r, self.cfg.vocab_size), jnp.float32) for r in rows)
        samplings = tuple(self._abstract_sampling(r) for r in rows)
        routes = tuple(self._abstract_group(group.rows, group.chunk, decode)[1] for group, decode in shape.groups)
        return slot_tokens, logits, logits, samplings, routes, cuts

    def _executables_for(self, shape: StepShape) -> _Executables:
        """`shape`'s executables, compiled now unless they are (one compile at a time; a compiled shape never
        waits for another's compile)."""
        found = self._executables.get(shape)
        if found is None:
            with self._compiling:
                found = self._executables.get(shape)
                if found is None:
                    found = self._executables[shape] = self._compile(shape)
                    if self.compile_sync is not None:
                        self.compile_sync.compiled(shape.key)
        return found

    def compile_ahead(self, stop: Callable[[], bool] | None = None) -> None:
        """Compile every bucket's shape in the order process 0 does, without running any (a follower's: its steps
        come from process 0, which warms each shape up; `replay` compiles a shape it meets first itself)."""
        for shape in self.buckets.shapes():
            if stop is not None and stop():
                return
            self._executables_for(shape)

    def _verifies(self, shape: StepShape) -> bool:
        """Whether `shape` runs as a verify step: a decode step with drafting on."""
        return bool(self.draft_tokens) and shape.kind is StepKind.DECODE

    def _compile(self, shape: StepShape) -> _Executables:
        with jax.set_mesh(self.mesh):
            if self._verifies(shape):
                assert shape.decode is not None  # a decode shape
                args = self._abstract_verify_args(shape.decode.rows)
                return _Executables(
                    self._speculate.lower(*args).compile(),
                    greedy=self._speculate.lower(*args, sampled=False).compile(),
                )
            forward = self._forward.lower(*self._abstract_forward_args(shape)).compile()
            for cuts in (False, True):
                if (shape.group_rows, cuts) not in self._samplers:
                    sampler = self._sampler.lower(*self._abstract_sampler_args(shape, cuts)).compile()
                    self._samplers[shape.group_rows, cuts] = sampler
        return _Executables(forward)

    def warmup(
        self,
        shapes: Sequence[StepShape] | None = None,
        show_progress: bool = False,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Compile `shapes` (default: every bucket), skipping those already compiled, in order; `stop()` is asked
        between shapes. Steps use only compiled shapes (limits()), so serving can start before all are done."""
        todo = [s for s in (self.buckets.shapes() if shapes is None else shapes) if s not in self._compiled]
        started = time.perf_counter()
        for i, shape in enumerate(todo, start=1):
            if stop is not None and stop():
                return
            t0 = time.perf_counter()
            compiled = self._executables_for(shape)
            if self.compile_sync is not None:
                self.compile_sync.wait_compiled(shape.key)
            # Run it once on padding rows (length 0: they write nothing), so the executable's first-call set-up
            # happens now rather than as a latency spike in the middle of serving.
            padding = [_Group((), group, decode) for group, decode in shape.groups]
            self._launch(shape, padding).result()
            if not self._verifies(shape):  # and the sampler that sorts, for a batch with a top-k / top-p row
                self._launch(shape, padding, sort=True).result()
            for group, _ in shape.groups:  # and the penalties' first bucket for its groups
                self._warm_penalties(group.rows)
            self._compiled[shape] = compiled  # now the engine may use it (a dict store is atomic)
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
        jax.block_until_ready(self._penalize(logits, PenaltyArrays.neutral(rows, PENALTY_BUCKET)))
        self._penalties_warmed.add(rows)

    def limits(self) -> StepLimits | None:
        """What steps the compiled shapes allow (None: not even one prefill and one decode shape yet)."""
        compiled = set(self._compiled)
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

    def _init_cache(self) -> None:
        with jax.set_mesh(self.mesh):
            self.cache = zeros_of(self._abstract_cache, self._cache_shardings)
            self.slot_tokens = jnp.zeros(self.geometry.num_slots, jnp.int32, device=self._replicated)

    # ---- stepping ----------------------------------------------------------------------------------------------
    def run(self, plan: StepPlan) -> StepOutput:
        """One step, waited for: the token sampled after each row and the logprobs its request asked for."""
        return self.dispatch(plan).result()

    def dispatch(self, plan: StepPlan) -> PendingStep | PendingVerify:
        """Start one step without waiting for it. Every row samples (after a chunk that is not its prompt's last,
        the token is neither kept nor returned as an output)."""
        groups = self._groups(plan)
        return self._launch(self._usable_shape(groups), groups)

    def executables(self, shape: StepShape) -> list[jax.stages.Compiled]:
        """A compiled step shape's executables, for static profiles and benchmarks: its forward, then the samplers it
        may run (the one that does not sort for top-k / top-p, then the one that does); a verify step's: the whole
        step, then its all-greedy variant. KeyError for a shape not compiled yet."""
        compiled = self._compiled[shape]
        if compiled.greedy is not None:
            return [compiled.forward, compiled.greedy]
        return [compiled.forward, *(self._samplers[shape.group_rows, cuts] for cuts in (False, True))]

    def device_seconds(self, plan: StepPlan, repeats: int, back_to_back: int = 1) -> list[float]:
        """Seconds per call of the compiled step of `plan` on inputs built once, `repeats` times: the step's time
        without the host's share (building inputs, scheduling, delivery). Each time is `back_to_back` calls made
        before waiting for the last, over their number: with one, the call's latency (its launch included); with
        more, the device's pace when it is never left waiting, as in the overlapped loop. For benchmarks: it
        rewrites the plan's KV positions with the same values."""
        if self.mirror is not None:
            raise RuntimeError("device_seconds times one process's calls; the other processes would not join them")
        groups = self._groups(plan)
        shape = self._usable_shape(groups)
        if self._verifies(shape):
            raise RuntimeError("device_seconds times plain steps; a verify step's tokens depend on its drafts")
        compiled = self._compiled[shape]
        inputs, routes, asked, drafting = self._host_inputs(groups)
        samplings = self._sampling_arrays(groups)
        sampler = self._sampler_for(tuple(group.shape.rows for group in groups), samplings)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(back_to_back):
                logits, _, self.cache = compiled.forward(
                    self.weights, self.cache, self.slot_tokens, inputs, routes, asked, drafting
                )
                outputs = sampler(self.slot_tokens, logits, logits, samplings, routes)
                self.slot_tokens = outputs[2]
            jax.block_until_ready(outputs)
            times.append((time.perf_counter() - started) / back_to_back)
        return times

    def _groups(self, plan: StepPlan) -> list[_Group]:
        """The plan's groups of rows, each with the compiled shape it runs in."""
        groups = []
        mixed = plan.kind is StepKind.MIXED
        if plan.prefill:
            shape = self._prefill_shape(len(plan.prefill), max(row.length for row in plan.prefill), mixed)
            groups.append(_Group(plan.prefill, shape, decode=False))
        if plan.decode:
            shape = self.buckets.mixed_decode_group if mixed else self._decode_shape(len(plan.decode))
            if len(plan.decode) > shape.rows:
                raise ValueError(f"decode batch {len(plan.decode)} exceeds the largest compiled bucket {shape.rows}")
            groups.append(_Group(plan.decode, shape, decode=True))
        return groups

    def _prefill_shape(self, rows: int, tokens: int, mixed: bool) -> GroupShape:
        """The cheapest compiled prefill group that holds `rows` chunks of up to `tokens` tokens."""
        kind = StepKind.MIXED if mixed else StepKind.PREFILL
        shapes = [s.prefill for s in list(self._compiled) if s.kind is kind and s.prefill is not None]
        fits = [(p.rows * p.chunk, p) for p in shapes if p.rows >= rows and p.chunk >= tokens]
        if not fits:
            raise ValueError(
                f"{rows} prefill rows of up to {tokens} tokens: no compiled {kind.value} step holds "
                f"them (the largest compiled one is {max(shapes, default=None)})"
            )
        return min(fits)[1]

    def _decode_shape(self, rows: int) -> GroupShape:
        sizes = [s.decode.rows for s in list(self._compiled) if s.kind is StepKind.DECODE and s.decode is not None]
        return GroupShape(min((d for d in sizes if d >= rows), default=max(sizes, default=0)), 1)

    def _usable_shape(self, groups: list[_Group]) -> StepShape:
        shape = StepShape(**{"decode" if group.decode else "prefill": group.shape for group in groups})
        if shape not in self._compiled:
            raise RuntimeError(f"step shape {shape} was not compiled; call warmup() first")
        return shape

    def _launch(self, shape: StepShape, groups: list[_Group], sort: bool = False) -> PendingStep | PendingVerify:
        """`sort`: the warm-up's padding rows sample through the sampler that sorts (see _launch_sampler)."""
        if self._verifies(shape):
            (group,) = groups
            return self._launch_verify(shape, group)
        inputs, routes, asked, drafting = self._host_inputs(groups)
        number, logits, prompt = self._run_forward(shape, inputs, routes, asked, drafting)
        return PendingStep(self, number, groups, logits, prompt, routes, asked, sort)

    def _launch_verify(self, shape: StepShape, group: _Group) -> PendingVerify:
        inputs = self._verify_arrays(group)
        params = SamplingArrays.for_rows(group.rows, group.shape.rows, self._all_tokens_allowed(group.shape.rows))
        executables = self._executables_for(shape)
        all_greedy = all(row.request.sampling.temperature == 0 for row in group.rows)
        step = executables.greedy if all_greedy and executables.greedy is not None else executables.forward
        with self._launching:
            self._next_forward += 1
            verified, self.cache, self.slot_tokens = step(self.weights, self.cache, self.slot_tokens, inputs, params)
        return PendingVerify(group.rows, verified)

    def _run_forward(self, shape: StepShape, inputs, routes, asked, drafting):
        executables = self._executables_for(shape)
        # The cache and the slot tokens are replaced: the warm-up's padding runs (on the compiling thread) and the
        # engine's steps must take turns (dispatch is asynchronous, so the lock is held only while a call is queued).
        # The mirror logs each call inside the lock, so the other processes replay the launch order.
        with self._launching:
            number, self._next_forward = self._next_forward, self._next_forward + 1
            if self.mirror is not None:
                self.mirror.add(ForwardCall(number, shape, inputs, routes, asked))
            logits, prompt, self.cache = executables.forward(
                self.weights, self.cache, self.slot_tokens, inputs, routes, asked, drafting
            )
        return number, logits, prompt

    def _launch_sampler(self, number: int, groups: list[_Group], logits, routes, sort: bool = False):
        # Asks the rows' grammars and token counts: after the tokens before these landed.
        samplings = self._sampling_arrays(groups)
        if sort:  # padding rows (their tokens are dropped) given a top-k, so the sorting sampler runs, here and
            # in every process that replays the call
            # (a host array, as for_rows makes them: hence Any)
            top_ks: Any = [np.ones_like(s.top_k) for s in samplings]
            samplings = tuple(dataclasses.replace(s, top_k=top_k) for s, top_k in zip(samplings, top_ks))
        penalties = tuple(PenaltyArrays.for_rows(group.rows, group.shape.rows) for group in groups)
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
                group_logits if p is None else self._penalize(group_logits, p)
                for group_logits, p in zip(logits, penalties)
            )
            tokens, sampled, self.slot_tokens = sampler(self.slot_tokens, logits, penalized, samplings, routes)
        return tokens, sampled

    def _sampler_for(self, rows: tuple[int, ...], samplings: tuple[SamplingArrays, ...]) -> jax.stages.Compiled:
        """The compiled sampler of groups of `rows`: the one that sorts only when some row cuts by top-k / top-p."""
        return self._samplers[rows, any(s.cuts() for s in samplings)]

    def replay(self, call: Call) -> None:
        """Run process 0's `call` on this process's devices (a follower's; jaxserve.runner.mirror)."""
        if isinstance(call, ForwardCall):
            if call.number != self._next_forward:  # checked before the call: it would consume the cache
                raise RuntimeError(
                    f"process 0's forward {call.number} replayed as this process's forward {self._next_forward}: "
                    "out of step"
                )
            drafting = (None,) * len(call.inputs)  # drafting never runs in a group (EngineConfig refuses it)
            number, logits, _ = self._run_forward(call.shape, call.inputs, call.routes, call.asked, drafting)
            self._replayed[number] = (logits, call.routes)
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

    def _sampling_arrays(self, groups: list[_Group]) -> tuple[SamplingArrays, ...]:
        return tuple(
            SamplingArrays.for_rows(group.rows, group.shape.rows, self._all_tokens_allowed(group.shape.rows))
            for group in groups
        )

    def _mask_shape(self, rows: int) -> tuple[int, int]:
        """A group's token masks: a bit per vocabulary id (sampling.SamplingArrays.allowed)."""
        return rows, mask_words(self.cfg.vocab_size)

    def _all_tokens_allowed(self, rows: int) -> jax.Array:
        mask = self._everything_allowed.get(rows)
        if mask is None:
            mask = jnp.full(self._mask_shape(rows), -1, jnp.int32, device=self._replicated)
            self._everything_allowed[rows] = mask
        return mask

    def _host_inputs(self, groups: list[_Group]):
        """(step inputs, token routes, logprob inputs), one of each per group."""
        arrays = [self._host_arrays(group) for group in groups]
        return tuple(tuple(a[i] for a in arrays) for i in range(4))

    def _host_arrays(self, group: _Group):
        max_pages, bucket_rows, chunk = self.geometry.max_pages_per_seq, group.shape.rows, group.shape.chunk
        # Host numpy arrays, filled in place: the jitted step takes them as its jax.Array inputs (hence Any).
        tokens: Any = np.zeros((bucket_rows, chunk), np.int32)
        page_table: Any = np.zeros((bucket_rows, max_pages), np.int32)
        positions: Any = np.zeros(bucket_rows, np.int32)
        lengths: Any = np.zeros(bucket_rows, np.int32)
        slots: Any = np.zeros(bucket_rows, np.int32)
        store: Any = np.full(bucket_rows, self.geometry.num_slots, np.int32)  # padding rows keep nothing
        asked: Any = _logprob_inputs(bucket_rows, chunk, np.zeros)
        # Prefill groups: where each row's sequence state comes from, and which snapshot it also writes (none:
        # past every state row, so the write is dropped).
        read_rows: Any = np.zeros(bucket_rows, np.int32)
        snapshot_rows: Any = np.full((bucket_rows, 1), self.geometry.state_rows, np.int32)
        snapshot_lengths: Any = np.zeros((bucket_rows, 1), np.int32)
        for i, row in enumerate(group.rows):
            request = row.request
            if len(request.pages) > max_pages:
                raise ValueError(f"row {i} has {len(request.pages)} pages; a page table holds {max_pages}")
            row_tokens = row.token_ids  # a decode row's token is on the device (feed_from_slot)
            tokens[i, : len(row_tokens)] = row_tokens
            page_table[i, : len(request.pages)] = request.pages
            positions[i], lengths[i], slots[i] = row.start, row.length, request.slot
            read_rows[i] = request.slot if row.read_row is None else row.read_row
            if row.snapshot_row is not None:
                snapshot_rows[i, 0], snapshot_lengths[i, 0] = row.snapshot_row, row.snapshot_tokens
            if row.samples_output:
                store[i] = request.slot
            asked.sampled[i] = row.logprobs is not None
            targets = row.prompt_logprob_targets
            if targets:
                asked.prompt[i] = True
                asked.targets[i, : len(targets)] = targets
        prefix_state = (
            {} if group.decode else dict(zip(PREFIX_STATE_INPUTS, (read_rows, snapshot_rows, snapshot_lengths)))
        )
        inputs = StepInputs(
            tokens=tokens, positions=positions, lengths=lengths, slots=slots, page_table=page_table, **prefix_state
        )
        feed_from_slot: Any = np.full(bucket_rows, group.decode)
        routes = TokenRoutes(feed_from_slot=feed_from_slot, store_slot=store)
        drafting = None
        if self.draft_tokens and not group.decode:  # each position's next prompt token, for the MTP block
            next_tokens: Any = np.zeros((bucket_rows, chunk), np.int32)
            draft_lengths: Any = np.zeros(bucket_rows, np.int32)
            for i, row in enumerate(group.rows):
                following = row.request.prompt_ids[row.start + 1 : row.start + row.length + 1]
                next_tokens[i, : len(following)], draft_lengths[i] = following, len(following)
            drafting = DraftInputs(next_tokens, draft_lengths)
        return inputs, routes, asked, drafting

    def _verify_arrays(self, group: _Group) -> StepInputs:
        """A verify group's inputs: each row's last sampled token's position, the tokens it may keep (StepRow.length),
        its slot's draft rows for the state as of 1..k of its tokens."""
        k, bucket_rows, geometry = self.draft_tokens, group.shape.rows, self.geometry
        host: dict[str, Any] = dict(
            tokens=np.zeros((bucket_rows, k + 1), np.int32),
            positions=np.zeros(bucket_rows, np.int32),
            lengths=np.zeros(bucket_rows, np.int32),
            slots=np.zeros(bucket_rows, np.int32),
            page_table=np.zeros((bucket_rows, geometry.max_pages_per_seq), np.int32),
            read_rows=np.zeros(bucket_rows, np.int32),
            snapshot_rows=np.full((bucket_rows, k), geometry.state_rows, np.int32),
            snapshot_lengths=np.zeros((bucket_rows, k), np.int32),
        )
        for i, row in enumerate(group.rows):
            request = row.request
            assert request.slot is not None  # a decoding request holds a slot
            host["positions"][i], host["lengths"][i] = row.start, row.length
            host["slots"][i] = host["read_rows"][i] = request.slot
            host["page_table"][i, : len(request.pages)] = request.pages
            for j in range(1, row.length):
                host["snapshot_rows"][i, j - 1] = geometry.draft_row(request.slot, j)
                host["snapshot_lengths"][i, j - 1] = j
        return StepInputs(**host)


# StepInputs' fields only a prefill group has: a decode group's rows read and write their own slots.
PREFIX_STATE_INPUTS = ("read_rows", "snapshot_rows", "snapshot_lengths")


def _logprob_inputs(rows: int, chunk: int, make: Callable) -> LogprobInputs:
    """A group's LogprobInputs, its arrays made by `make(shape, dtype)` (host zeros, or abstract values): prompt
    logprobs only for a prefill group; a decode group (one token per row) has no prompt tokens, so its step has no
    branch for them."""
    sampled = make((rows,), np.bool_)
    if chunk == 1:
        return LogprobInputs(sampled=sampled)
    return LogprobInputs(sampled=sampled, prompt=make((rows,), np.bool_), targets=make((rows, chunk), np.int32))


def _fetch(out: GroupOutput, rows: tuple[StepRow, ...], asked: LogprobInputs) -> tuple[RowOutput, ...]:
    """One group's outputs on the host, row by row; logprobs are copied from the device only for rows that asked."""
    tokens = np.asarray(out.tokens)[: len(rows)]
    sampled: list[TokenLogprob | None] = [None] * len(rows)
    prompt: list[list[TokenLogprob] | None] = [None] * len(rows)
    if asked.sampled.any():
        values = jax.device_get(out.sampled)
        for i, row in enumerate(rows):
            if row.logprobs is not None:
                sampled[i] = to_host(
                    tokens[i : i + 1],
                    values.token[i : i + 1],
                    values.top_ids[i : i + 1],
                    values.top[i : i + 1],
                    row.logprobs,
                )[0]
    if asked.prompt is not None and asked.prompt.any():
        values = jax.device_get(out.prompt)
        for i, row in enumerate(rows):
            targets = row.prompt_logprob_targets
            k = row.request.sampling.prompt_logprobs
            if targets and k is not None:  # targets exist only for requests that asked
                n = len(targets)
                prompt[i] = to_host(targets, values.token[i, :n], values.top_ids[i, :n], values.top[i, :n], k)
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
    )
