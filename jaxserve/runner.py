"""The device side: two jitted steps, *prefill a chunk* and *decode one step*, over weights on a mesh.

Both are the same pure function `(weights, cache, inputs, sampling) -> (token ids, cache)` with the cache
donated, compiled ahead of time for a small set of shape buckets (rows x chunk length for prefill, rows for
decode). A call whose shape is not a bucket is an error, never a silent recompile.
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

from jaxserve.cache import CacheGeometry, abstract_cache, init_cache
from jaxserve.config import ModelConfig
from jaxserve.model.forward import logits_last
from jaxserve.model.inputs import StepInputs
from jaxserve.sampling import SamplingArrays, sample
from jaxserve.sharding import shardings_for

log = logging.getLogger("jaxserve.runner")


def powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (limit,)


@dataclass(frozen=True)
class Buckets:
    prefill_rows: tuple[int, ...]
    prefill_chunks: tuple[int, ...]
    decode_rows: tuple[int, ...]

    @staticmethod
    def for_limits(max_prefill_rows: int, chunked_prefill_size: int, max_num_seqs: int,
                   min_chunk: int = 16) -> "Buckets":
        # Chunks grow by 4x: each bucket costs a compile at start-up, padding costs only a little compute.
        chunks, size = [], min(min_chunk, chunked_prefill_size)
        while size < chunked_prefill_size:
            chunks.append(size)
            size *= 4
        return Buckets(prefill_rows=powers_of_two_up_to(max_prefill_rows),
                       prefill_chunks=tuple(chunks) + (chunked_prefill_size,),
                       decode_rows=powers_of_two_up_to(max_num_seqs))

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, chunk length) that is compiled; decode is chunk length 1."""
        return [(r, c) for r in self.prefill_rows for c in self.prefill_chunks] + [(r, 1) for r in self.decode_rows]


def _fit(sizes: Sequence[int], need: int, what: str) -> int:
    for size in sizes:
        if size >= need:
            return size
    raise ValueError(f"{what} {need} exceeds the largest compiled bucket {max(sizes)}")


@dataclass
class Row:
    """One row of a step: `tokens` at positions `position..`, for the sequence in `slot` with `pages`."""

    tokens: Sequence[int]
    position: int
    slot: int
    pages: Sequence[int]
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int = 0


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
    compile_s: dict[tuple[int, int], float] = field(default_factory=dict)


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
        self._compiled: dict[tuple[int, int], jax.stages.Compiled] = {}
        self.times = StepTimes()

    def _step_fn(self, weights, cache, inputs: StepInputs, sampling: SamplingArrays):
        logits, cache = logits_last(weights, cache, inputs, self.cfg)
        return sample(logits, sampling), cache

    # ---- compilation -------------------------------------------------------------------------------------------
    def _abstract_args(self, rows: int, chunk: int):
        def arr(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

        inputs = StepInputs(tokens=arr((rows, chunk), jnp.int32), positions=arr((rows,), jnp.int32),
                            lengths=arr((rows,), jnp.int32), slots=arr((rows,), jnp.int32),
                            page_table=arr((rows, self.geometry.max_pages_per_seq), jnp.int32))
        sampling = SamplingArrays(temperature=arr((rows,), jnp.float32), top_k=arr((rows,), jnp.int32),
                                  top_p=arr((rows,), jnp.float32), seed=arr((rows,), jnp.uint32),
                                  position=arr((rows,), jnp.int32))
        weights = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.weights)
        cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.cache)
        return weights, cache, inputs, sampling

    def warmup(self, show_progress: bool = False) -> None:
        """Compile every bucket now, so serving never compiles."""
        shapes = self.buckets.shapes()
        started = time.perf_counter()
        for i, (rows, chunk) in enumerate(shapes, start=1):
            if (rows, chunk) in self._compiled:
                continue
            t0 = time.perf_counter()
            with jax.set_mesh(self.mesh):
                self._compiled[(rows, chunk)] = self._step.lower(*self._abstract_args(rows, chunk)).compile()
            elapsed = time.perf_counter() - t0
            self.times.compile_s[(rows, chunk)] = elapsed
            kind = "decode" if chunk == 1 else "prefill"
            log.info("compiled %s rows=%d chunk=%d in %.2f s (%d/%d)", kind, rows, chunk, elapsed, i, len(shapes))
            if show_progress:
                print(f"\rcompiling [{i}/{len(shapes)}] {kind} rows={rows} chunk={chunk} "
                      f"{time.perf_counter() - started:6.1f}s", end="" if i < len(shapes) else "\n", flush=True)

    def cache_lost(self) -> bool:
        """True when a failed call consumed the donated cache."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache))

    def reset_cache(self) -> None:
        with jax.set_mesh(self.mesh):
            self.cache = init_cache(self.cfg, self.geometry, self._cache_shardings)

    # ---- stepping ----------------------------------------------------------------------------------------------
    def prefill(self, rows: Sequence[Row]) -> np.ndarray:
        """Run prompt chunks (one per row); returns the token sampled after each row's last chunk token."""
        bucket_rows = _fit(self.buckets.prefill_rows, len(rows), "prefill rows")
        chunk = _fit(self.buckets.prefill_chunks, max(len(r.tokens) for r in rows), "prefill chunk length")
        return self._run(rows, bucket_rows, chunk)

    def decode(self, rows: Sequence[Row]) -> np.ndarray:
        """One token per row; returns the next token of each."""
        if any(len(r.tokens) != 1 for r in rows):
            raise ValueError("decode rows carry exactly one token each")
        return self._run(rows, _fit(self.buckets.decode_rows, len(rows), "decode batch"), 1)

    def _run(self, rows: Sequence[Row], bucket_rows: int, chunk: int) -> np.ndarray:
        compiled = self._compiled.get((bucket_rows, chunk))
        if compiled is None:
            raise RuntimeError(f"bucket rows={bucket_rows} chunk={chunk} was not compiled; call warmup() first")
        inputs, sampling = self._host_arrays(rows, bucket_rows, chunk)
        tokens, self.cache = compiled(self.weights, self.cache, inputs, sampling)
        return np.asarray(tokens)[: len(rows)]

    def _host_arrays(self, rows: Sequence[Row], bucket_rows: int, chunk: int):
        n = len(rows)
        max_pages = self.geometry.max_pages_per_seq
        tokens = np.zeros((bucket_rows, chunk), np.int32)
        page_table = np.zeros((bucket_rows, max_pages), np.int32)
        positions = np.zeros(bucket_rows, np.int32)
        lengths = np.zeros(bucket_rows, np.int32)
        slots = np.zeros(bucket_rows, np.int32)
        for i, row in enumerate(rows):
            if len(row.pages) > max_pages:
                raise ValueError(f"row {i} has {len(row.pages)} pages; a page table holds {max_pages}")
            tokens[i, : len(row.tokens)] = row.tokens
            page_table[i, : len(row.pages)] = row.pages
            positions[i], lengths[i], slots[i] = row.position, len(row.tokens), row.slot
        pad = bucket_rows - n
        sampling = SamplingArrays.build(
            temperature=[r.temperature for r in rows] + [0.0] * pad,
            top_k=[r.top_k for r in rows] + [-1] * pad,
            top_p=[r.top_p for r in rows] + [1.0] * pad,
            seed=[r.seed for r in rows] + [0] * pad,
            position=list(positions + np.maximum(lengths, 1)),  # the sampled token's own position
        )
        inputs = StepInputs(tokens=tokens, positions=positions, lengths=lengths, slots=slots, page_table=page_table)
        return inputs, sampling
