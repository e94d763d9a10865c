"""The executable cache: each step shape's jitted calls, compiled once, ahead of the first step that needs them.

A step is two calls (docs/architecture.md, "the device side"): the forward, `(weights, cache, slot tokens, each
group's GroupInputs) -> (logits at each row's last token, prompt logprobs, cache)` with the cache donated, and the
sampler, `(slot tokens, logits, penalized logits, sampling, routes) -> (tokens, their logprobs, slot tokens)`; with
drafting on a decode shape is one verify call instead (jaxserve.runner.speculative), and a mixed shape the verify
call with its prompt chunks in the same forward, then the sampler of the prompt rows. Every call is made with keyword
arguments, the names of its parameters, as it was lowered.

A shape's abstract arguments come from the builders of its real ones (jaxserve.runner.inputs, SamplingArrays),
applied to the shape's padding groups and made abstract; the state's (weights, cache, slot tokens) from the state's
own description with its shardings. The cache compiles for whatever devices the mesh holds, real or deviceless (a GPU
target compiled here: jaxserve.runner.targets), and runs nothing.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.kernels.table import Kernels
from jaxserve.model.cache import CacheGeometry
from jaxserve.model.forward import last_logits, output_states, tapped_streams
from jaxserve.model.sharding import shape_dtype_structs, shardings_for
from jaxserve.request.grammar import mask_words
from jaxserve.request.step import StepShape
from jaxserve.runner.export_store import ExportStore, JitSpec, describe, store_folder
from jaxserve.runner.inputs import GroupInputs, StepGroup, TokenRoutes, group_inputs, padding_groups, verify_inputs
from jaxserve.runner.logprobs import prompt_logprobs, sampled_logprobs
from jaxserve.runner.mirror import CompileSync
from jaxserve.runner.sampling import SamplingArrays, apply_penalties, sample
from jaxserve.runner.speculative import (
    SpeculativeCache,
    VerifyInputs,
    abstract_runner_cache,
    decoding_from,
    prefill_drafts,
    speculative_step,
)


@dataclass(frozen=True)
class ShapeExecutables:
    """One step shape's compiled forward (its samplers are kept by their groups' rows: ExecutableCache.sampler)."""

    forward: jax.stages.Compiled  # a verify step's whole step with drafting on (it samples inside)
    # A verify step's variant for batches whose every row is greedy: no sampling filter, only argmaxes.
    greedy: jax.stages.Compiled | None = None


class ExecutableCache:
    """Step shape -> its executables, each compiled once (one compile at a time; a compiled shape never waits for
    another's compile). `weights`: arrays or ShapeDtypeStructs with their shardings on `mesh`."""

    def __init__(self, cfg: ModelConfig, weights: Any, geometry: CacheGeometry, mesh: Mesh, kernels: Kernels):
        self.cfg, self.geometry, self.mesh, self.kernels = cfg, geometry, mesh, kernels
        self.replicated = NamedSharding(mesh, PartitionSpec())
        # What the runner keeps between steps, described (ArrayInfo leaves), and where each array lives.
        self.abstract_cache = abstract_cache = abstract_runner_cache(cfg, geometry)
        self.cache_shardings = shardings_for(abstract_cache, mesh)
        # The state every call takes, abstract with its shardings.
        self._state = dict(
            weights=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), weights),
            cache=shape_dtype_structs(abstract_cache, mesh),
            slot_tokens=self.abstract((geometry.num_slots,), jnp.int32),
        )
        # The calls, each jitted from one spec (the export store makes its thin call of the same spec).
        options = kernels.compiler_options
        self._forward = JitSpec(
            self._forward_fn,
            donate_argnames=("cache",),
            out_shardings=(self.replicated, self.replicated, self.cache_shardings),
            compiler_options=options,
        )
        self._sampler = JitSpec(
            self._sampler_fn, static_argnames=("cuts",), out_shardings=self.replicated, compiler_options=options
        )
        self._speculate = JitSpec(
            self._speculate_fn,
            static_argnames=("sampled",),
            donate_argnames=("cache",),
            out_shardings=(self.replicated, self.replicated, self.replicated, self.cache_shardings, self.replicated),
            compiler_options=options,
        )
        # Only groups with a penalized row take it (compiled once per penalty bucket reached, when first needed).
        self.penalize = JitSpec(
            lambda logits, penalties: kernels.rows(apply_penalties, logits, penalties),
            out_shardings=self.replicated,
            compiler_options=options,
        ).jitted
        self._compiled: dict[StepShape, ShapeExecutables] = {}
        self._compiling = threading.Lock()
        # By the rows of each group and whether some row cuts by top-k / top-p (the sampler that sorts).
        self._samplers: dict[tuple[tuple[int, ...], bool], jax.stages.Compiled] = {}
        self.compile_sync: CompileSync | None = None  # in a group: each process says when it compiled a shape
        # What every call closes over, for the export store's keys (fixed for this cache: described once).
        self._closure = describe((cfg, geometry, kernels, mesh))

    # ---- the calls ---------------------------------------------------------------------------------------------
    def _forward_fn(self, weights, cache, slot_tokens: jax.Array, groups: tuple[GroupInputs, ...]):
        steps = tuple(
            dataclasses.replace(
                g.step,
                tokens=jnp.where(g.routes.feed_from_slot[:, None], slot_tokens[g.step.slots][:, None], g.step.tokens),
            )
            for g in groups
        )
        speculative = isinstance(cache, SpeculativeCache)
        kv = cache.kv if speculative else cache
        hs, kv, taps, pres = tapped_streams(weights, kv, steps, self.cfg, self.kernels, tap=self.cfg.dspark_drafting)
        if speculative:
            cache = self._prompt_drafting(weights, dataclasses.replace(cache, kv=kv), hs, taps, groups)
        else:
            cache = kv
        logits, prompts = self._logits(weights, hs, groups, pres)
        return logits, prompts, cache

    def _prompt_drafting(
        self, weights, cache: SpeculativeCache, hs: list[jax.Array], taps, groups: tuple[GroupInputs, ...]
    ) -> SpeculativeCache:
        """The drafter over the prompt chunks of a step (`hs`, `taps`: each group's last streams and taps), and the
        positions of the slots whose prompt a row completes (where their verify steps start)."""
        draft, positions = cache.draft, cache.positions
        for i, (h, group) in enumerate(zip(hs, groups)):
            if group.drafting is not None:  # prefill groups: the drafter reads the chunk too
                completes = group.routes.store_slot < self.geometry.num_slots
                tap = None if taps is None else taps[i]
                draft = prefill_drafts(
                    weights, draft, h, tap, group.step, group.drafting, completes, self.cfg, self.kernels
                )
                positions = decoding_from(positions, group.step, completes)
        return dataclasses.replace(cache, draft=draft, positions=positions)

    def _logits(self, weights, hs: list[jax.Array], groups: tuple[GroupInputs, ...], pres=None):
        """Each group's logits at its rows' last tokens, and its prompt logprobs (None where not asked). `pres`:
        DeepSeek-V4.1's last collapse weights per group (forward.output_states)."""
        logits, prompts = [], []
        for i, (h, group) in enumerate(zip(hs, groups)):
            y = output_states(weights, h, None if pres is None else pres[i], self.cfg, self.kernels)
            asked = group.asked
            logits.append(last_logits(y, group.step, weights.head, self.cfg.vocab_size, self.kernels))
            prompt = None
            if asked.targets is not None and asked.prompt is not None:  # prefill groups only (group_inputs)
                prompt = prompt_logprobs(
                    y, weights.head, asked.targets, asked.prompt, self.cfg.vocab_size, self.kernels
                )
            prompts.append(prompt)
        return tuple(logits), tuple(prompts)

    def _speculate_fn(
        self,
        weights,
        cache: SpeculativeCache,
        slot_tokens: jax.Array,
        inputs: VerifyInputs,
        params: SamplingArrays,
        prompts: tuple[GroupInputs, ...] = (),
        sampled: bool = True,
    ):
        """A verify step, and a mixed step's prompt chunks (`prompts`) in the same forward: (Verified, the prompt
        groups' logits and prompt logprobs, for their sampler, cache, slot tokens)."""
        verified, hs, taps, cache, slot_tokens = speculative_step(
            weights,
            cache,
            slot_tokens,
            inputs,
            params,
            self.geometry,
            self.cfg,
            self.kernels,
            sampled,
            prompts=[group.step for group in prompts],
        )
        cache = self._prompt_drafting(weights, cache, hs, taps, prompts)
        logits, prompt_logprobs = self._logits(weights, hs, prompts)
        return verified, logits, prompt_logprobs, cache, slot_tokens

    def _sampler_fn(
        self,
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
            group_tokens = self.kernels.rows(lambda x, p: sample(x, p, cuts), to_sample, sampling)
            slot_tokens = slot_tokens.at[route.store_slot].set(group_tokens, mode="drop")
            tokens.append(group_tokens)
            sampled.append(self.kernels.rows(sampled_logprobs, group_logits, group_tokens))
        return tuple(tokens), tuple(sampled), slot_tokens

    # ---- abstract arguments ------------------------------------------------------------------------------------
    def abstract(self, shape, dtype) -> Any:  # stands in for a jax.Array in the abstract inputs
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

    def _abstract_like(self, host: Any) -> Any:
        """Abstract values of these host inputs (replicated)."""
        return jax.tree.map(lambda x: self.abstract(x.shape, x.dtype), host)

    def mask_shape(self, rows: int) -> tuple[int, int]:
        """A group's token masks: a bit per vocabulary id (sampling.SamplingArrays.allowed)."""
        return rows, mask_words(self.cfg.vocab_size)

    def _samplings(self, groups: list[StepGroup]) -> tuple[SamplingArrays, ...]:
        """The groups' sampling arrays, every token allowed (a host mask: only its shape is read)."""
        masks: list[Any] = [np.zeros(self.mask_shape(g.shape.rows), np.int32) for g in groups]
        return tuple(SamplingArrays.for_group(g.rows, g.shape.rows, mask) for g, mask in zip(groups, masks))

    def _forward_args(self, shape: StepShape) -> dict[str, Any]:
        groups = tuple(group_inputs(group, self.geometry) for group in padding_groups(shape))
        return dict(**self._state, groups=self._abstract_like(groups))

    def _sampler_args(self, shape: StepShape, cuts: bool) -> dict[str, Any]:
        """`cuts` (static): the sampler that sorts (the one that needs more memory) or the one that does not."""
        padding = padding_groups(shape)
        logits = tuple(self.abstract((rows, self.cfg.vocab_size), jnp.float32) for rows in shape.group_rows)
        return dict(
            slot_tokens=self._state["slot_tokens"],
            logits=logits,
            penalized=logits,
            samplings=self._abstract_like(self._samplings(padding)),
            routes=self._abstract_like(tuple(group_inputs(g, self.geometry).routes for g in padding)),
            cuts=cuts,
        )

    def _verify_args(self, shape: StepShape, sampled: bool) -> dict[str, Any]:
        padding = padding_groups(shape)
        (verify,) = [group for group in padding if group.decode]
        prompts = tuple(group_inputs(group, self.geometry) for group in padding if not group.decode)
        inputs, params = self._abstract_like((verify_inputs(verify, self.geometry), self._samplings([verify])[0]))
        return dict(**self._state, inputs=inputs, params=params, prompts=self._abstract_like(prompts), sampled=sampled)

    def _lowerings(self, shape: StepShape) -> list[tuple[JitSpec, dict[str, Any]]]:
        """The calls of `shape`, each its jit's spec and its abstract arguments: the forward and the sampler that
        sorts, or the sampled verify step (and a mixed one's sampler of its prompt rows)."""
        if self.verifies(shape):
            calls = [(self._speculate, self._verify_args(shape, sampled=True))]
            if (prompts := self._prompt_shape(shape)) is not None:
                calls.append((self._sampler, self._sampler_args(prompts, cuts=True)))
            return calls
        return [(self._forward, self._forward_args(shape)), (self._sampler, self._sampler_args(shape, cuts=True))]

    # ---- compiling ---------------------------------------------------------------------------------------------
    def verifies(self, shape: StepShape) -> bool:
        """Whether `shape` runs as a verify step (with its prompt chunks, if mixed): one with decode rows, with
        drafting on."""
        return bool(self.geometry.draft_tokens) and shape.decode is not None

    @staticmethod
    def _prompt_shape(shape: StepShape) -> StepShape | None:
        """A mixed verify step's prompt rows as a step of their own: what their sampler is compiled for."""
        return None if shape.prefill is None or shape.decode is None else StepShape(prefill=shape.prefill)

    def get(self, shape: StepShape) -> ShapeExecutables:
        """`shape`'s executables, compiled now unless they are."""
        found = self._compiled.get(shape)
        if found is None:
            with self._compiling:
                found = self._compiled.get(shape)
                if found is None:
                    found = self._compiled[shape] = self._compile(shape)
                    if self.compile_sync is not None:
                        self.compile_sync.compiled(shape.key)
        return found

    def _compile(self, shape: StepShape) -> ShapeExecutables:
        with jax.set_mesh(self.mesh):
            if self.verifies(shape):
                if (prompts := self._prompt_shape(shape)) is not None:
                    self._compile_samplers(prompts)
                return ShapeExecutables(
                    self._compile_call("speculate", self._speculate, self._verify_args(shape, sampled=True)),
                    greedy=self._compile_call("speculate", self._speculate, self._verify_args(shape, sampled=False)),
                )
            forward = self._compile_call("forward", self._forward, self._forward_args(shape))
            self._compile_samplers(shape)
        return ShapeExecutables(forward)

    def _compile_samplers(self, shape: StepShape) -> None:
        """The samplers of `shape`'s groups (the one that sorts and the one that does not), unless compiled."""
        for cuts in (False, True):
            if (shape.group_rows, cuts) not in self._samplers:
                sampler = self._compile_call("sampler", self._sampler, self._sampler_args(shape, cuts))
                self._samplers[shape.group_rows, cuts] = sampler

    def _compile_call(self, name: str, spec: JitSpec, args: dict[str, Any]) -> jax.stages.Compiled:
        """One call compiled, through the export store while JAX's persistent compilation cache is on (a later
        start then skips tracing it)."""
        folder = store_folder()
        if folder is None:
            return spec.jitted.lower(**args).compile()
        return ExportStore(folder, self._closure).compile(name, spec, args)

    def compile(self, shape: StepShape) -> list[list[jax.stages.Compiled]]:
        """`shape` compiled now, as the engine compiles it, whether or not it was before (the engine's steps keep
        using what they had): the executables a step runs one after the other, each the list of its variants of which
        a step runs one: [[forward], [sampler, sorting sampler]], or a verify step's [[sampled, greedy]] (a mixed one's
        then [sampler, sorting sampler] of its prompt rows). For compile benchmarks and GPU targets; a sampler
        compiled before for the same rows is reused."""
        return self._variants(shape, self._compile(shape))

    def _variants(self, shape: StepShape, executables: ShapeExecutables) -> list[list[jax.stages.Compiled]]:
        if executables.greedy is not None:  # a verify step's two variants, then a mixed one's prompt samplers
            prompts = self._prompt_shape(shape)
            samplers = [] if prompts is None else [[self._samplers[prompts.group_rows, c] for c in (False, True)]]
            return [[executables.forward, executables.greedy], *samplers]
        return [[executables.forward], [self._samplers[shape.group_rows, cuts] for cuts in (False, True)]]

    def executables(self, shape: StepShape) -> list[jax.stages.Compiled]:
        """A compiled shape's executables, for static profiles and benchmarks: its forward, then the samplers it may
        run (the one that does not sort, then the one that does); a verify step's: the whole step, then its
        all-greedy variant (then a mixed one's prompt samplers). KeyError for a shape not compiled yet."""
        return [compiled for variants in self._variants(shape, self._compiled[shape]) for compiled in variants]

    def sampler(self, rows: tuple[int, ...], cuts: bool) -> jax.stages.Compiled:
        """The compiled sampler of groups of `rows`; `cuts`: the one that sorts."""
        return self._samplers[rows, cuts]

    def jaxprs(self, shape: StepShape) -> list[ClosedJaxpr]:
        """The calls of `shape` as traced, before XLA sees them (see _lowerings)."""
        with jax.set_mesh(self.mesh):
            return [spec.jitted.trace(**args).jaxpr for spec, args in self._lowerings(shape)]

    def temp_bytes(self, shape: StepShape, compiler_options: dict[str, Any]) -> int:
        """XLA's temporaries of the calls of `shape` (per device), compiled with `compiler_options`."""
        total = 0
        with jax.set_mesh(self.mesh):
            for spec, args in self._lowerings(shape):
                analysis = spec.jitted.lower(**args).compile(compiler_options=compiler_options).memory_analysis()
                if analysis is None:
                    raise RuntimeError("XLA has no memory analysis of the compiled step on these devices")
                total += int(analysis.temp_size_in_bytes)
        return total
