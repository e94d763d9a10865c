"""Drive jaxserve's forward over a schedule of chunks for several rows at once, collecting per-position logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.model.cache import CacheGeometry, abstract_cache, init_cache
from jaxserve.model.forward import logits_all
from jaxserve.model.inputs import StepInputs
from jaxserve.model.sharding import shardings_for
from jaxserve.model.weights import init_weights
from jaxserve.paging import pages_needed

forward_all = jax.jit(logits_all, static_argnames=("cfg",), donate_argnames=("cache",))


def geometry_for(cfg: ModelConfig, rows: int, max_len: int, kv_cache_dtype: str = "auto") -> CacheGeometry:
    rates = [cfg.compress_rate(i) for i in cfg.compressed_layers] or [1]
    page_size = int(np.lcm.reduce(rates))
    per_seq = pages_needed(max_len, page_size)
    return CacheGeometry(
        num_slots=rows,
        num_pages=rows * per_seq + 1,
        page_size=page_size,
        max_pages_per_seq=per_seq,
        kv_cache_dtype=kv_cache_dtype,
    )


def run_schedule(
    weights,
    cfg: ModelConfig,
    prompts: list[np.ndarray],
    steps: list[list[int]],
    buckets: tuple[int, ...],
    forward=forward_all,
    mesh=None,
    kv_cache_dtype: str = "auto",
) -> list[np.ndarray]:
    """steps[k][r] = tokens row r processes at step k (0 = idle). Each step is one call whose chunk length is
    the smallest bucket that holds its longest row, so a whole schedule compiles once per bucket used.

    Rows use slots in reverse order and interleaved pages, so nothing relies on row == slot or on contiguity.
    With a `mesh`, `weights` must already be placed on it; the cache is sharded like the runner's.
    `kv_cache_dtype` stores the cache as the knob of that name does.
    """
    rows = len(prompts)
    geo = geometry_for(cfg, rows, max(len(p) for p in prompts), kv_cache_dtype)
    if mesh is None:
        cache = init_cache(cfg, geo)
    else:
        cache = init_cache(cfg, geo, shardings_for(abstract_cache(cfg, geo), mesh))
    # Page p of row r is global page 1 + p * rows + r: interleaved across rows, page 0 never used.
    page_table = np.array([[1 + p * rows + r for p in range(geo.max_pages_per_seq)] for r in range(rows)], np.int32)
    slots = np.arange(rows, dtype=np.int32)[::-1].copy()
    done = [0] * rows
    outputs: list[list[np.ndarray]] = [[] for _ in range(rows)]
    for sizes in steps:
        chunk = min(b for b in buckets if b >= max(sizes))
        tokens = np.zeros((rows, chunk), np.int32)
        for r, n in enumerate(sizes):
            assert n <= chunk and done[r] + n <= len(prompts[r]), (r, n, done[r])
            tokens[r, :n] = prompts[r][done[r] : done[r] + n]
        inputs = StepInputs(
            tokens=jnp.asarray(tokens),
            positions=jnp.asarray(done, jnp.int32),
            lengths=jnp.asarray(sizes, jnp.int32),
            slots=jnp.asarray(slots),
            page_table=jnp.asarray(page_table),
        )
        if mesh is None:
            logits, cache = forward(weights, cache, inputs, cfg=cfg)
        else:
            inputs = jax.device_put(inputs, NamedSharding(mesh, PartitionSpec()))
            with jax.set_mesh(mesh):
                logits, cache = forward(weights, cache, inputs, cfg=cfg)
        logits = np.asarray(logits)
        for r, n in enumerate(sizes):
            outputs[r].append(logits[r, :n])
            done[r] += n
    assert done == [len(p) for p in prompts], done
    return [np.concatenate(o) for o in outputs]


def chunk_schedule(lengths_per_row: list[list[int]]) -> list[list[int]]:
    """Zip per-row chunk lists into steps; a row with no chunk left idles (length 0)."""
    n_steps = max(len(c) for c in lengths_per_row)
    return [[c[k] if k < len(c) else 0 for c in lengths_per_row] for k in range(n_steps)]


def prefill_then_decode(prefill: list[int], totals: list[int]) -> list[list[int]]:
    """One prefill chunk per row, then one token per step until each row reaches its total."""
    steps = [list(prefill)]
    done = list(prefill)
    while done != totals:
        step = [1 if d < t else 0 for d, t in zip(done, totals)]
        done = [d + s for d, s in zip(done, step)]
        steps.append(step)
    return steps


def memorizing_weights(cfg: ModelConfig, sequences: np.ndarray, steps: int = 50, seed: int = 5):
    """`cfg`'s random weights trained with Adam (lr 3e-3) until they predict every next token of `sequences`
    [rows, length] from the whole prefix: a model that is sure of its continuations, as trained models are of
    theirs and random ones never are. Returns (weights, final mean cross-entropy)."""
    rows, length = sequences.shape
    geo = geometry_for(cfg, rows, length)
    page_table = np.array([[1 + p * rows + r for p in range(geo.max_pages_per_seq)] for r in range(rows)], np.int32)
    inputs = StepInputs(
        tokens=jnp.asarray(sequences),
        positions=jnp.zeros(rows, jnp.int32),
        lengths=jnp.full(rows, length, jnp.int32),
        slots=jnp.arange(rows, dtype=jnp.int32),
        page_table=jnp.asarray(page_table),
    )
    targets = jnp.asarray(sequences[:, 1:])

    def loss(weights):
        logits, _ = logits_all(weights, init_cache(cfg, geo), inputs, cfg)
        logprobs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logprobs, targets[..., None], axis=-1).mean()

    def trained(leaf) -> bool:
        return jnp.issubdtype(leaf.dtype, jnp.floating)  # not the hash-routing tables

    @jax.jit
    def adam(weights, m, v, t):
        value, grads = jax.value_and_grad(loss, allow_int=True)(weights)

        def update(w, g, m, v):
            if not trained(w):
                return w, m, v
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
            return w - 3e-3 * (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.999**t)) + 1e-8), m, v

        updated = jax.tree.map(update, weights, grads, m, v)
        part = lambda i: jax.tree.map(lambda u: u[i], updated, is_leaf=lambda u: isinstance(u, tuple))  # noqa: E731
        return value, part(0), part(1), part(2)

    weights = init_weights(jax.random.key(seed), cfg, std=0.15)
    m = v = jax.tree.map(lambda w: jnp.zeros_like(w) if trained(w) else w, weights)
    for t in range(1, steps + 1):
        value, weights, m, v = adam(weights, m, v, float(t))
    return weights, float(value)
