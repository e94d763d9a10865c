"""DeepSeek-V4.1's engram: at a few layers each position fetches table rows addressed by hashes of the n-grams
(2..max_ngram tokens) ending at it, over the compressed token vocabulary (jaxserve.text.ngram_vocab), and writes a
gated projection of them into the hyper-connection streams.

The hash (per engram layer L, position p): tokens_i = compressed id of the token at p - i (i = 0..max_ngram-1; the
compressed pad id once the look-back reaches the sequence start or a dead token), products_i = tokens_i *
multiplier[L][i] (< 2^63 by construction of the multipliers), and for n-gram size n and head h the id
`(XOR_{i<n} products_i) mod prime[L][n, h] + offset[L][n, h]`.

JAX runs without 64-bit integers, so the products live in a host-built table (`product_table`) as 32-bit halves per
raw token id; on the device they are gathered, XORed half by half (XOR acts on the halves independently) and reduced
modulo each prime with uint32 arithmetic only: `hi mod p`, then one byte of `lo` at a time, `r = (r * 256 + byte) mod
p`, every intermediate below 2^32 because p < 2^24. Hence `EngramLayout.build`'s limit on the primes.

Letters: b rows, t chunk time, l engram layers, i look-back, c hash columns ((n-gram size - 2) * n_heads + head),
k table row width (head_dim), h hyper-connection streams, d hidden size, n the projection's outputs (d * (h + 1)).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngramConfig
from jaxserve.kernels.quant import scale_values

F32 = jnp.float32
U32 = jnp.uint32
PRIME_LIMIT = 1 << 24  # the byte-wise reduction keeps r * 256 + 255 below 2^32 only for primes below this
SCALE_BLOCK = 32  # table channels per ue8m0 scale
GATE_CLAMP = 1e-6  # |dot| floor before the signed square root, as the reference
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic Miller-Rabin below 3.3e24


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for q in _MR_BASES:
        if n % q == 0:
            return n == q
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab_size: int) -> np.ndarray:
    """int64 [layers, max_ngram]: odd multipliers, one per (layer, look-back), from a numpy generator seeded by the
    layer id (so layers hash differently), bounded so that any compressed id times one stays below 2^63."""
    bound = max(1, (int(np.iinfo(np.int64).max) // compressed_vocab_size) // 2)
    rows = [
        np.random.default_rng(10007 * layer).integers(low=0, high=bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
        for layer in layer_ids
    ]
    return np.stack(rows).astype(np.int64) if rows else np.zeros((0, max_ngram), np.int64)


@jax.tree_util.register_static
@dataclass(frozen=True)
class EngramLayout:
    """The engram layers' hash layout, static under jit. Per layer, flat over the hash columns (n-gram size major,
    then head): the primes (each column owns a prime-sized bucket range; the primes are drawn in order above
    `engram_vocab_size`, restarting for every n-gram size but never reused, across the layers in order) and the
    offsets of those ranges in the layer's table (cumulative; `rows` is the table's size)."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    head_dim: int
    primes: tuple[tuple[int, ...], ...]  # [layers][cols]
    offsets: tuple[tuple[int, ...], ...]  # [layers][cols]
    multipliers: tuple[tuple[int, ...], ...]  # [layers][max_ngram], odd, < 2^63 / compressed_vocab_size
    rows: tuple[int, ...]  # [layers], table rows (sum of the layer's primes)
    compressed_vocab_size: int

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_cols(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    @classmethod
    def build(
        cls,
        layer_ids: tuple[int, ...] | list[int],
        vocab_size: int,
        max_ngram: int,
        n_heads: int,
        head_dim: int,
        compressed_vocab_size: int,
    ) -> EngramLayout:
        """From the checkpoint config: `vocab_size` is `engram_vocab_size` (the primes start above it),
        `compressed_vocab_size` the size of the tokenizer's compressed map."""
        layer_ids = tuple(int(i) for i in layer_ids)
        if max_ngram < 2 or n_heads < 1 or head_dim % SCALE_BLOCK:
            raise ValueError(
                f"engram needs max_ngram >= 2, n_heads >= 1 and head_dim a multiple of {SCALE_BLOCK}; got "
                f"max_ngram={max_ngram}, n_heads={n_heads}, head_dim={head_dim}"
            )
        seen: set[int] = set()
        primes: list[tuple[int, ...]] = []
        for _ in layer_ids:
            layer: list[int] = []
            for _ in range(max_ngram - 1):
                candidate = vocab_size
                for _ in range(n_heads):
                    while candidate in seen or not _is_prime(candidate):
                        candidate += 1
                    seen.add(candidate)
                    layer.append(candidate)
            primes.append(tuple(layer))
        if seen and max(seen) >= PRIME_LIMIT:
            raise ValueError(
                f"engram_vocab_size={vocab_size} gives hash primes up to {max(seen)}, but the device hashing reduces "
                f"modulo primes below 2^24 = {PRIME_LIMIT} only (uint32 arithmetic)"
            )
        offsets = tuple(tuple(int(o) for o in np.cumsum((0,) + layer[:-1])) for layer in primes)
        rows = tuple(sum(layer) for layer in primes)
        if rows and max(rows) >= 1 << 31:
            raise ValueError(f"engram tables of {max(rows)} rows cannot be addressed with int32 ids")
        multipliers = hash_multipliers(layer_ids, max_ngram, compressed_vocab_size)
        return cls(
            layer_ids=layer_ids,
            max_ngram=max_ngram,
            n_heads=n_heads,
            head_dim=head_dim,
            primes=tuple(primes),
            offsets=offsets,
            multipliers=tuple(tuple(int(m) for m in row) for row in multipliers),
            rows=rows,
            compressed_vocab_size=compressed_vocab_size,
        )


def product_table(layout: EngramLayout, token_map: np.ndarray, pad_compressed_id: int) -> np.ndarray:
    """uint32 [vocab + 1, layers, max_ngram, 2]: for every raw token id (row `vocab`: the pad token's compressed id
    `pad_compressed_id`, what the look-back reads before the sequence start or past a dead token) its compressed id
    times each (layer, look-back) multiplier, as (high, low) 32-bit halves. Built once on the host, where 64-bit
    integers are at hand."""
    token_map = np.asarray(token_map)
    if token_map.ndim != 1 or token_map.min(initial=0) < 0 or token_map.max(initial=0) >= layout.compressed_vocab_size:
        raise ValueError(f"token_map must be 1-D with ids in [0, {layout.compressed_vocab_size})")
    if not 0 <= pad_compressed_id < layout.compressed_vocab_size:
        raise ValueError(
            f"pad id {pad_compressed_id} is outside the compressed vocabulary [0, {layout.compressed_vocab_size})"
        )
    ids = np.concatenate([token_map.astype(np.uint64), np.array([pad_compressed_id], np.uint64)])
    multipliers = np.array(layout.multipliers, np.uint64).reshape(layout.n_layers, layout.max_ngram)
    products = ids[:, None, None] * multipliers[None]  # < 2^63: no wrap
    return np.stack([products >> np.uint64(32), products & np.uint64(0xFFFFFFFF)], axis=-1).astype(np.uint32)


def mod_u64(hi: jax.Array, lo: jax.Array, prime: jax.Array) -> jax.Array:
    """(hi * 2^32 + lo) mod prime, all uint32 (broadcasting), exact for prime < 2^24: hi mod p, then lo's bytes from
    the top, each step below p * 256 <= 2^32."""
    r = hi % prime
    for shift in (24, 16, 8, 0):
        r = ((r << 8) | ((lo >> shift) & 0xFF)) % prime
    return r


def hash_ids(context: jax.Array, tokens: jax.Array, table: jax.Array, layout: EngramLayout) -> jax.Array:
    """int32 [b, t, layers, cols]: the engram row ids of a chunk's positions.

    tokens [b, t] int32: the chunk's raw token ids; context [b, max_ngram - 1] int32: the raw ids right before the
    chunk, oldest first. A negative id is dead (before the sequence start, or a position kept out of n-grams): the
    look-back stops there, and it and everything older read as the pad id, as in the reference. Ids past the table
    read the pad row. table: `product_table`'s, on the device.
    """
    n = layout.max_ngram
    b, t = tokens.shape
    vocab = table.shape[0] - 1
    full = jnp.concatenate([context.astype(jnp.int32), tokens.astype(jnp.int32)], axis=1)  # [b, n - 1 + t]
    primes = jnp.asarray(np.array(layout.primes, np.uint32).reshape(layout.n_layers, n - 1, layout.n_heads))
    offsets = jnp.asarray(np.array(layout.offsets, np.int32).reshape(layout.n_layers, layout.n_cols))
    blocked = jnp.zeros((b, t), bool)
    hi = lo = jnp.zeros((b, t, layout.n_layers), U32)
    columns = []
    for i in range(n):
        source = jax.lax.dynamic_slice_in_dim(full, n - 1 - i, t, axis=1)  # the token i back, [b, t]
        blocked = blocked | (source < 0)
        row = jnp.where(blocked, vocab, jnp.minimum(source, vocab))
        products = table[row, :, i, :]  # [b, t, l, 2]
        hi, lo = hi ^ products[..., 0], lo ^ products[..., 1]
        if i > 0:  # the (i + 1)-gram's hash, modulo each of its heads' primes
            columns.append(mod_u64(hi[..., None], lo[..., None], primes[:, i - 1]))  # [b, t, l, heads]
    return jnp.concatenate(columns, axis=-1).astype(jnp.int32) + offsets


def lookup(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """Gathered rows of an FP8 e4m3 table, codes [..., head_dim] with their ue8m0 scales [..., head_dim / 32],
    decoded to float32 (exact). The caller gathers: only the rows asked for are read and decoded, the tables are
    huge."""
    codes = codes.astype(F32)
    values = codes.reshape(*codes.shape[:-1], -1, SCALE_BLOCK) * scale_values(scales)[..., None]
    return values.reshape(codes.shape)


def engram_mix(
    streams: jax.Array,  # [b, t, h, d]
    kv: jax.Array,  # [b, t, d * (h + 1)]: the looked-up rows' projection, h keys then one value
    q_weight: jax.Array,  # [h, d]
    k_weight: jax.Array,  # [h, d]
    eps: float,
    token_mask: jax.Array | None = None,  # [b, t] bool; False leaves the position's streams untouched
) -> jax.Array:
    """The streams with the engram's value added, per stream gated by how well the stream matches that stream's key:
    a sigmoid of the signed square root of their normalized dot product (weights q * k, used only as a product,
    norms per (token, stream) over d, scaled by 1 / sqrt(d)). Float32 throughout; returns the streams' dtype."""
    b, t, h, d = streams.shape
    kv = kv.astype(F32)
    key = kv[..., : h * d].reshape(b, t, h, d)
    value = kv[..., h * d :]  # [b, t, d]
    weight = q_weight.astype(F32) * k_weight.astype(F32)
    x = streams.astype(F32)
    rstd = jax.lax.rsqrt(jnp.mean(x * x, -1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + eps)
    dot = jnp.sum(x * weight * key, -1) * rstd * d**-0.5  # [b, t, h]
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), GATE_CLAMP)), dot))
    if token_mask is not None:
        gate = jnp.where(token_mask[..., None], gate, 0.0)
    return (x + gate[..., None] * value[:, :, None, :]).astype(streams.dtype)


@functools.cache
def engram_layout(engram: EngramConfig) -> EngramLayout:
    """The hash layout a model's Engram config implies."""
    return EngramLayout.build(
        engram.layer_ids,
        engram.vocab_size,
        engram.max_ngram,
        engram.n_heads,
        engram.head_dim,
        engram.compressed_vocab_size,
    )
