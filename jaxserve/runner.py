"""The device side: two jitted steps, *prefill a chunk* and *decode one step*, over weights on a mesh.

Both are the same pure function `(weights, cache, inputs, sampling, logprob inputs) -> (outputs, cache)` with
the cache donated (outputs: the sampled token ids and the logprobs rows asked for, see jaxserve.logprobs),
compiled ahead of time for a small set of shape buckets (rows x chunk length for prefill, rows for decode). A
call whose shape is not a bucket is an error, never a silent recompile.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.cache import CacheGeometry, abstract_cache, init_cache, kv_geometry
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.logprobs import LogprobInputs, Logprobs, prompt_logprobs, sampled_logprobs, to_host
from jaxserve.model.forward import hidden_states, last_logits
from jaxserve.model.inputs import StepInputs
from jaxserve.request import Batch, Request, TokenLogprob
from jaxserve.sampling import SamplingArrays, sample
from jaxserve.sharding import shardings_for

log = logging.getLogger("jaxserve.runner")


def powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (limit,)


GroupShape = tuple[int, int]  # (rows, chunk length) of one group of rows
GroupRow = tuple[Sequence[int], int, Request]  # a row's tokens, the position of the first, and its request
StepShape = tuple[GroupShape, ...]  # one compiled step: a prefill group, a decode group, or both (mixed)


@jax.tree_util.register_dataclass
@dataclass
class GroupOutput:
    """One group's outputs of a step: the sampled tokens [b], their Logprobs [b], the prompt Logprobs [b, t]."""

    tokens: jax.Array
    sampled: Logprobs
    prompt: Logprobs


@dataclass(frozen=True)
class StepResult:
    """What one step hands back, row by row in batch order (None where a row's request did not ask)."""

    prefill_tokens: np.ndarray  # the token sampled after each prefill chunk
    decode_tokens: np.ndarray  # the next token of each decode row
    prefill_logprobs: list[TokenLogprob | None]  # the sampled token's (sampling.logprobs)
    decode_logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[list[TokenLogprob] | None]  # each chunk's next prompt tokens' (sampling.prompt_logprobs)


@dataclass(frozen=True)
class Buckets:
    prefill_rows: tuple[int, ...]
    prefill_chunks: tuple[int, ...]
    decode_rows: tuple[int, ...]
    mixed: bool = False  # also compile prefill steps that carry a decode group

    @staticmethod
    def for_limits(max_prefill_rows: int, chunked_prefill_size: int, max_num_seqs: int,
                   min_chunk: int = 16, mixed: bool = False) -> "Buckets":
        # Chunks grow by 4x: each bucket costs a compile at start-up, padding costs only a little compute.
        chunks, size = [], min(min_chunk, chunked_prefill_size)
        while size < chunked_prefill_size:
            chunks.append(size)
            size *= 4
        return Buckets(prefill_rows=powers_of_two_up_to(max_prefill_rows),
                       prefill_chunks=tuple(chunks) + (chunked_prefill_size,),
                       decode_rows=powers_of_two_up_to(max_num_seqs), mixed=mixed)

    def shapes(self) -> list[StepShape]:
        """Every step shape that is compiled; decode groups have chunk length 1."""
        prefill = [(r, c) for r in self.prefill_rows for c in self.prefill_chunks]
        decode = [(r, 1) for r in self.decode_rows]
        mixed = [(p, d) for p in prefill for d in decode] if self.mixed else []
        return [(p,) for p in prefill] + [(d,) for d in decode] + mixed


def _fit(sizes: Sequence[int], need: int, what: str) -> int:
    for size in sizes:
        if size >= need:
            return size
    raise ValueError(f"{what} {need} exceeds the largest compiled bucket {max(sizes)}")


class CompileCounter:
    """Counts JAX traces and backend compiles in this process (to prove there are none after warm-up)."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_):
        if event in self.EVENTS:
            self.count += 1


@dataclass
class StepTimes:
    compile_s: dict[StepShape, float] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights, geometry: CacheGeometry, mesh: Mesh, buckets: Buckets):
        self.cfg = cfg
        self.geometry = geometry
        self.mesh = mesh
        self.buckets = buckets
        self.weights = weights
        abstract = abstract_cache(cfg, geometry)
        self._cache_shardings = shardings_for(abstract, mesh)
        self._weight_shardings = jax.tree.map(lambda x: x.sharding, weights)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self.reset_cache()
        self._step = jax.jit(
            self._step_fn,
            donate_argnames=("cache",),
            out_shardings=(self._replicated, self._cache_shardings),
        )
        self._compiled: dict[StepShape, jax.stages.Compiled] = {}
        self.times = StepTimes()

    def _step_fn(self, weights, cache, groups: tuple[StepInputs, ...], samplings: tuple[SamplingArrays, ...],
                 logprob_inputs: tuple[LogprobInputs, ...]):
        ys, cache = hidden_states(weights, cache, groups, self.cfg)
        outputs = []
        for y, inputs, sampling, asked in zip(ys, groups, samplings, logprob_inputs):
            logits = last_logits(y, inputs, weights.head)
            tokens = sample(logits, sampling)
            outputs.append(GroupOutput(tokens, sampled_logprobs(logits, tokens, asked.sampled),
                                       prompt_logprobs(y, weights.head, asked.targets, asked.prompt)))
        return tuple(outputs), cache

    # ---- compilation -------------------------------------------------------------------------------------------
    def _abstract_group(self, rows: int, chunk: int) -> tuple[StepInputs, SamplingArrays, LogprobInputs]:
        def arr(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

        inputs = StepInputs(tokens=arr((rows, chunk), jnp.int32), positions=arr((rows,), jnp.int32),
                            lengths=arr((rows,), jnp.int32), slots=arr((rows,), jnp.int32),
                            page_table=arr((rows, self.geometry.max_pages_per_seq), jnp.int32))
        sampling = SamplingArrays(temperature=arr((rows,), jnp.float32), top_k=arr((rows,), jnp.int32),
                                  top_p=arr((rows,), jnp.float32), seed=arr((rows,), jnp.uint32),
                                  position=arr((rows,), jnp.int32))
        asked = LogprobInputs(sampled=arr((rows,), jnp.bool_), prompt=arr((rows,), jnp.bool_),
                              targets=arr((rows, chunk), jnp.int32))
        return inputs, sampling, asked

    def _abstract_args(self, shape: StepShape):
        groups = [self._abstract_group(rows, chunk) for rows, chunk in shape]
        weights = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.weights)
        cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.cache)
        return weights, cache, *(tuple(g[i] for g in groups) for i in range(3))

    def warmup(self, show_progress: bool = False) -> None:
        """Compile every bucket now, so serving never compiles."""
        shapes = self.buckets.shapes()
        started = time.perf_counter()
        for i, shape in enumerate(shapes, start=1):
            if shape in self._compiled:
                continue
            t0 = time.perf_counter()
            with jax.set_mesh(self.mesh):
                self._compiled[shape] = self._step.lower(*self._abstract_args(shape)).compile()
            # Run it once on padding rows (length 0: they write nothing), so the executable's first-call set-up
            # happens now rather than as a latency spike in the middle of serving.
            self._run([([], group) for group in shape])
            elapsed = time.perf_counter() - t0
            self.times.compile_s[shape] = elapsed
            described = " + ".join(f"{'decode' if c == 1 else 'prefill'} rows={r} chunk={c}" for r, c in shape)
            log.info("compiled %s in %.2f s (%d/%d)", described, elapsed, i, len(shapes))
            if show_progress:
                print(f"\rcompiling [{i}/{len(shapes)}] {described} {time.perf_counter() - started:6.1f}s\033[K",
                      end="" if i < len(shapes) else "\n", flush=True)

    def cache_lost(self) -> bool:
        """True when a failed call consumed the donated cache."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache))

    def reset_cache(self) -> None:
        with jax.set_mesh(self.mesh):
            self.cache = init_cache(self.cfg, self.geometry, self._cache_shardings)

    # ---- stepping ----------------------------------------------------------------------------------------------
    def run(self, batch: Batch) -> StepResult:
        """One step: the token sampled after each prefill chunk, the next token of each decode row, and the
        logprobs their requests asked for.

        A chunk that is not its prompt's last still samples (its token is simply not used)."""
        groups = []
        if batch.prefill:
            rows = [(c.token_ids, c.start, c.request) for c in batch.prefill]
            chunk = _fit(self.buckets.prefill_chunks, max(c.length for c in batch.prefill), "prefill chunk length")
            groups.append((rows, (_fit(self.buckets.prefill_rows, len(rows), "prefill rows"), chunk)))
        if batch.decode:
            rows = [([r.output_ids[-1]], r.total_len - 1, r) for r in batch.decode]
            groups.append((rows, (_fit(self.buckets.decode_rows, len(rows), "decode batch"), 1)))
        if batch.prefill and batch.decode and not self.buckets.mixed:
            raise RuntimeError("mixed steps were not compiled (Buckets.mixed is off)")
        outputs = self._run(groups)
        prefill = outputs[0] if batch.prefill else _NO_ROWS
        decode = outputs[-1] if batch.decode else _NO_ROWS
        return StepResult(prefill.tokens, decode.tokens, prefill.sampled, decode.sampled, prefill.prompt)

    def _run(self, groups: list[tuple[list[GroupRow], GroupShape]]) -> list["_HostGroup"]:
        shape = tuple(group_shape for _, group_shape in groups)
        compiled = self._compiled.get(shape)
        if compiled is None:
            raise RuntimeError(f"step shape {shape} was not compiled; call warmup() first")
        arrays = [self._host_arrays(rows, *group_shape) for rows, group_shape in groups]
        outputs, self.cache = compiled(self.weights, self.cache, *(tuple(a[i] for a in arrays) for i in range(3)))
        return [_HostGroup.fetch(out, rows, asked) for out, (rows, _), (_, _, asked) in zip(outputs, groups, arrays)]

    def _host_arrays(self, rows: list[GroupRow], bucket_rows: int, chunk: int):
        max_pages = self.geometry.max_pages_per_seq
        tokens = np.zeros((bucket_rows, chunk), np.int32)
        page_table = np.zeros((bucket_rows, max_pages), np.int32)
        positions = np.zeros(bucket_rows, np.int32)
        lengths = np.zeros(bucket_rows, np.int32)
        slots = np.zeros(bucket_rows, np.int32)
        asked = LogprobInputs(sampled=np.zeros(bucket_rows, bool), prompt=np.zeros(bucket_rows, bool),
                              targets=np.zeros((bucket_rows, chunk), np.int32))
        for i, (row_tokens, position, request) in enumerate(rows):
            if len(request.pages) > max_pages:
                raise ValueError(f"row {i} has {len(request.pages)} pages; a page table holds {max_pages}")
            tokens[i, : len(row_tokens)] = row_tokens
            page_table[i, : len(request.pages)] = request.pages
            positions[i], lengths[i], slots[i] = position, len(row_tokens), request.slot
            # Only a token that is output has its logprobs taken (not the unused one after a mid-prompt chunk).
            outputs_a_token = position + len(row_tokens) >= request.prompt_len
            asked.sampled[i] = request.sampling.logprobs is not None and outputs_a_token
            targets = _prompt_targets(request, position, len(row_tokens))
            asked.prompt[i] = len(targets) > 0
            asked.targets[i, : len(targets)] = targets
        # Each row samples the token after its last one, at that token's own position.
        sampling = SamplingArrays.for_rows([r.sampling for _, _, r in rows], positions + np.maximum(lengths, 1))
        inputs = StepInputs(tokens=tokens, positions=positions, lengths=lengths, slots=slots, page_table=page_table)
        return inputs, sampling, asked


def _prompt_targets(request: Request, position: int, length: int) -> list[int]:
    """The prompt tokens whose logprobs a row computes: the one after each of its positions, for a prefill row of
    a request that asked (the token after the prompt's last is sampled, not a prompt token)."""
    if request.sampling.prompt_logprobs is None:
        return []
    return request.prompt_ids[position + 1: position + length + 1]


@dataclass(frozen=True)
class _HostGroup:
    """One group's outputs on the host; logprobs are copied from the device only for rows that asked."""

    tokens: np.ndarray
    sampled: list[TokenLogprob | None]
    prompt: list[list[TokenLogprob] | None]

    @staticmethod
    def fetch(out: GroupOutput, rows: list[GroupRow], asked: LogprobInputs) -> "_HostGroup":
        tokens = np.asarray(out.tokens)[: len(rows)]
        sampled: list[TokenLogprob | None] = [None] * len(rows)
        prompt: list[list[TokenLogprob] | None] = [None] * len(rows)
        if asked.sampled.any():
            values = jax.device_get(out.sampled)
            for i, (_, _, request) in enumerate(rows):
                if asked.sampled[i]:
                    sampled[i] = to_host(tokens[i:i + 1], values.token[i:i + 1], values.top_ids[i:i + 1],
                                         values.top[i:i + 1], request.sampling.logprobs)[0]
        if asked.prompt.any():
            values = jax.device_get(out.prompt)
            for i, (row_tokens, position, request) in enumerate(rows):
                targets = _prompt_targets(request, position, len(row_tokens))
                if targets:
                    n = len(targets)
                    prompt[i] = to_host(targets, values.token[i, :n], values.top_ids[i, :n], values.top[i, :n],
                                        request.sampling.prompt_logprobs)
        return _HostGroup(tokens, sampled, prompt)


_NO_ROWS = _HostGroup(np.zeros(0, np.int32), [], [])


def build_runner(engine_cfg: EngineConfig, model_cfg: ModelConfig, weights, mesh: Mesh) -> ModelRunner:
    """The runner (KV geometry and step buckets) these knobs ask for."""
    buckets = Buckets.for_limits(engine_cfg.max_prefill_rows, engine_cfg.chunked_prefill_size,
                                 engine_cfg.max_num_seqs, mixed=engine_cfg.mixed_batches)
    return ModelRunner(model_cfg, weights, kv_geometry(engine_cfg, model_cfg), mesh, buckets)
