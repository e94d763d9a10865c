"""The device side: two jitted steps, *prefill a chunk* and *decode one step*, over weights on a mesh.

A step is two calls, launched one after the other: the forward, `(weights, cache, slot tokens, each group's
GroupInputs) -> (logits at each row's last token, prompt logprobs, cache)` with the cache donated, and the
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
from jaxserve.request.batch import GroupBatch, LateInputs, StepBatch
from jaxserve.request.grammar import mask_words
from jaxserve.request.step import (
    MIXED_PREFILL_ROWS,
    GroupShape,
    RowOutput,
    StepKind,
    StepLimits,
    StepOutput,
    StepShape,
)
from jaxserve.runner.logprobs import LogprobInputs, Logprobs, prompt_logprobs, sampled_logprobs, to_host
from jaxserve.runner.mirror import Call, CallLog, CompileSync, ForwardCall, ResetCall, SampleCall
from jaxserve.runner.sampling import (
    PENALTY_BUCKET,
    PenaltyArrays,
    SamplingArrays,
    apply_penalties,
    sample,
)
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
class _Group:
    """One group of a step's rows and the compiled shape they run in."""

    rows: GroupBatch
    shape: GroupShape

    @property
    def decode(self) -> bool:
        return self.rows.decode


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
    """A dispatched verify step (speculative decoding): drafting, verifying and sampling are one call, so there is
    no sampler to launch; `result()` waits for its tokens."""

    def __init__(self, rows: int, verified: Verified):
        self._rows, self._verified = rows, verified
        verified.tokens.copy_to_host_async()

    def sample(self) -> None:
        pass

    def result(self) -> StepOutput:
        tokens, counts = np.asarray(self._verified.tokens), np.asarray(self._verified.counts)
        outputs = []
        for i in range(self._rows):
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
        groups: tuple[GroupInputs, ...],
    ):
        steps = tuple(
            dataclasses.replace(
                g.step,
                tokens=jnp.where(g.routes.feed_from_slot[:, None], slot_tokens[g.step.slots][:, None], g.step.tokens),
            )
            for g in groups
        )
        speculative = isinstance(cache, SpeculativeCache)
        hs, kv = hidden_streams(weights, cache.kv if speculative else cache, steps, self.cfg, self.kernels)
        if speculative:
            draft = cache.draft
            for h, inputs, group in zip(hs, steps, groups):
                if group.drafting is not None:  # prefill groups: the MTP block reads the chunk too
                    completes = group.routes.store_slot < self.geometry.num_slots
                    draft = prefill_drafts(weights, draft, h, inputs, group.drafting, completes, self.cfg, self.kernels)
            cache = SpeculativeCache(kv, draft)
        else:
            cache = kv
        ys = [
            final_norm(h, weights.hc_head_fn, weights.hc_head_base, weights.hc_head_scale, weights.norm, self.cfg)
            for h in hs
        ]
        logits, prompts = [], []
        for y, inputs, group in zip(ys, steps, groups):
            asked = group.asked
            logits.append(last_logits(y, inputs, weights.head, self.cfg.vocab_size))
            prompt = None
            if asked.targets is not None and asked.prompt is not None:  # prefill groups only (_group_inputs)
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

    def _abstract_like(self, host: Any) -> Any:
        """Abstract values of these host inputs (replicated), for lowering: so a step's abstract arguments come from
        the builders of its real ones, never from a second description of them."""
        return jax.tree.map(lambda x: self._abstract(x.shape, x.dtype), host)

    def _abstract_state(self) -> tuple:
        """The weights, the cache and the slot tokens, abstract with their shardings."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            (self.weights, self.cache, self.slot_tokens),
        )

    @staticmethod
    def _padding(shape: StepShape) -> list[_Group]:
        """`shape`'s groups with no rows: every row padding (warm-up, abstract arguments)."""
        return [_Group(GroupBatch.padding(decode), group) for group, decode in shape.groups]

    def _abstract_verify_args(self, shape: StepShape) -> tuple:
        (group,) = self._padding(shape)
        inputs, params = self._abstract_like((self._verify_arrays(group), self._sampling_arrays([group])[0]))
        return (*self._abstract_state(), inputs, params)

    def _abstract_forward_args(self, shape: StepShape) -> tuple:
        return (*self._abstract_state(), self._abstract_like(self._host_inputs(self._padding(shape))))

    def _abstract_sampler_args(self, shape: StepShape, cuts: bool = True) -> tuple:
        """The sampler's arguments for `shape`'s groups; `cuts` (static): the sampler that sorts, by default (the
        one that needs more memory)."""
        padding = self._padding(shape)
        slot_tokens = self._abstract_state()[2]
        logits = tuple(self._abstract((r, self.cfg.vocab_size), jnp.float32) for r in shape.group_rows)
        samplings = self._abstract_like(self._sampling_arrays(padding))
        routes = self._abstract_like(tuple(group.routes for group in self._host_inputs(padding)))
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
                args = self._abstract_verify_args(shape)
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

    def compile(self, shape: StepShape) -> list[list[jax.stages.Compiled]]:
        """`shape` compiled now, as the engine compiles it, whether or not it was before (the engine's steps keep
        using what they had): the executables a step runs one after the other, each the list of its variants of which
        a step runs one: [[forward], [sampler, sorting sampler]], or a verify step's [[sampled, greedy]]. For compile
        benchmarks and GPU targets; a sampler compiled before for the same rows is reused."""
        executables = self._compile(shape)
        if executables.greedy is not None:  # a verify step's two variants
            return [[executables.forward, executables.greedy]]
        return [[executables.forward], [self._samplers[shape.group_rows, cuts] for cuts in (False, True)]]

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
            padding = self._padding(shape)
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
        step, then its all-greedy variant. KeyError for a shape not compiled yet."""
        compiled = self._compiled[shape]
        if compiled.greedy is not None:
            return [compiled.forward, compiled.greedy]
        return [compiled.forward, *(self._samplers[shape.group_rows, cuts] for cuts in (False, True))]

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
        if self._verifies(shape):
            raise RuntimeError("device_seconds times plain steps; a verify step's tokens depend on its drafts")
        compiled = self._compiled[shape]
        inputs = self._host_inputs(groups)
        routes = tuple(group.routes for group in inputs)
        samplings = self._sampling_arrays(groups, [late.masks for late in self._late_inputs(groups)])
        sampler = self._sampler_for(tuple(group.shape.rows for group in groups), samplings)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(back_to_back):
                logits, _, self.cache = compiled.forward(self.weights, self.cache, self.slot_tokens, inputs)
                outputs = sampler(self.slot_tokens, logits, logits, samplings, routes)
                self.slot_tokens = outputs[2]
            jax.block_until_ready(outputs)
            times.append((time.perf_counter() - started) / back_to_back)
        return times

    def _groups(self, batch: StepBatch) -> list[_Group]:
        """The batch's groups of rows, each with the compiled shape it runs in."""
        groups = []
        if (prefill := batch.prefill) is not None:
            groups.append(_Group(prefill, self._prefill_shape(prefill.num_rows, prefill.longest, batch.mixed)))
        if (decode := batch.decode) is not None:
            shape = self.buckets.mixed_decode_group if batch.mixed else self._decode_shape(decode.num_rows)
            if decode.num_rows > shape.rows:
                raise ValueError(f"decode batch {decode.num_rows} exceeds the largest compiled bucket {shape.rows}")
            groups.append(_Group(decode, shape))
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
        inputs = self._host_inputs(groups)
        number, logits, prompt = self._run_forward(shape, inputs)
        return PendingStep(self, number, groups, logits, prompt, inputs, sort)

    def _launch_verify(self, shape: StepShape, group: _Group) -> PendingVerify:
        inputs = self._verify_arrays(group)
        (params,) = self._sampling_arrays([group])
        executables = self._executables_for(shape)
        all_greedy = all(p.temperature == 0 for p in group.rows.params)
        step = executables.greedy if all_greedy and executables.greedy is not None else executables.forward
        with self._launching:
            self._next_forward += 1
            verified, self.cache, self.slot_tokens = step(self.weights, self.cache, self.slot_tokens, inputs, params)
        return PendingVerify(group.rows.num_rows, verified)

    def _run_forward(self, shape: StepShape, inputs: tuple[GroupInputs, ...]):
        executables = self._executables_for(shape)
        # The cache and the slot tokens are replaced: the warm-up's padding runs (on the compiling thread) and the
        # engine's steps must take turns (dispatch is asynchronous, so the lock is held only while a call is queued).
        # The mirror logs each call inside the lock, so the other processes replay the launch order.
        with self._launching:
            number, self._next_forward = self._next_forward, self._next_forward + 1
            if self.mirror is not None:
                self.mirror.add(ForwardCall(number, shape, inputs))
            logits, prompt, self.cache = executables.forward(self.weights, self.cache, self.slot_tokens, inputs)
        return number, logits, prompt

    def _launch_sampler(self, number: int, groups: list[_Group], logits, routes, sort: bool = False):
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
        self, groups: list[_Group], masks: Sequence[np.ndarray | None] | None = None
    ) -> tuple[SamplingArrays, ...]:
        """Each group's sampling arrays; `masks`: its late token masks (None: every token allowed, by a mask kept on
        the device, so no mask is copied there)."""
        masks = masks or [None] * len(groups)
        return tuple(
            SamplingArrays.for_group(group.rows, group.shape.rows, self._all_tokens_allowed(group.shape.rows), mask)
            for group, mask in zip(groups, masks)
        )

    def _late_inputs(self, groups: list[_Group]) -> list[LateInputs]:
        """Each group's late inputs (GroupBatch.late), asked once its step's sampler is about to launch."""
        return [group.rows.late(self._mask_shape(group.shape.rows)[1]) for group in groups]

    def _mask_shape(self, rows: int) -> tuple[int, int]:
        """A group's token masks: a bit per vocabulary id (sampling.SamplingArrays.allowed)."""
        return rows, mask_words(self.cfg.vocab_size)

    def _all_tokens_allowed(self, rows: int) -> jax.Array:
        mask = self._everything_allowed.get(rows)
        if mask is None:
            mask = jnp.full(self._mask_shape(rows), -1, jnp.int32, device=self._replicated)
            self._everything_allowed[rows] = mask
        return mask

    def _host_inputs(self, groups: list[_Group]) -> tuple[GroupInputs, ...]:
        return tuple(self._group_inputs(group) for group in groups)

    def _group_inputs(self, group: _Group) -> GroupInputs:
        """A group's device inputs, padded to its compiled shape (host arrays)."""
        rows, bucket_rows, chunk, geometry = group.rows, group.shape.rows, group.shape.chunk, self.geometry
        pad = _padder(bucket_rows)
        slots = pad(rows.slots)
        prefix_state = {}
        if not group.decode:  # where each row's sequence state comes from, and which snapshot it also writes (none:
            # past every state row, so the write is dropped)
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
            slots=slots,
            page_table=self._page_table(rows, pad),
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
        if self.draft_tokens and not group.decode:  # each position's next prompt token, for the MTP block
            drafting = DraftInputs(pad(rows.next_tokens, chunk), pad(rows.next_counts))
        return GroupInputs(inputs, routes, asked, drafting)

    def _page_table(self, rows: GroupBatch, pad: Callable[..., Any]) -> Any:
        max_pages = self.geometry.max_pages_per_seq
        if rows.page_counts.max(initial=0) > max_pages:
            i = int(np.argmax(rows.page_counts))
            raise ValueError(f"row {i} has {rows.page_counts[i]} pages; a page table holds {max_pages}")
        return pad(rows.page_table, max_pages)

    def _verify_arrays(self, group: _Group) -> StepInputs:
        """A verify group's inputs: each row's last sampled token's position, the tokens it may keep (its length),
        its slot's draft rows for the state as of 1..k of its tokens."""
        rows, k, geometry = group.rows, self.draft_tokens, self.geometry
        pad = _padder(group.shape.rows)
        snapshot_rows = np.full((rows.num_rows, k), geometry.state_rows, np.int32)
        snapshot_lengths = np.zeros((rows.num_rows, k), np.int32)
        for i, (slot, length) in enumerate(zip(rows.slots, rows.lengths)):
            for j in range(1, int(length)):
                snapshot_rows[i, j - 1], snapshot_lengths[i, j - 1] = geometry.draft_row(int(slot), j), j
        return StepInputs(
            tokens=pad(np.zeros((rows.num_rows, k + 1), np.int32)),
            positions=pad(rows.positions),
            lengths=pad(rows.lengths),
            slots=pad(rows.slots),
            page_table=self._page_table(rows, pad),
            read_rows=pad(rows.slots),
            snapshot_rows=pad(snapshot_rows, fill=geometry.state_rows),
            snapshot_lengths=pad(snapshot_lengths),
        )


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
    )
