"""DeepSeek-V4.1's engram: the compressed token map, the hash layout and the device-side hashing against the data
transformers' own code produced (tests/data/v41_tiny/reference.json, key `engram`), and the lookup and mix maths."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tokenizers

from jaxserve.model import engram
from jaxserve.text.ngram_vocab import compressed_token_map
from jaxserve.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "data" / "v41_tiny" / "reference.json"
CHECKPOINT = REPO / "checkpoints" / "default"
# The tiny config the reference was made with.
LAYER_IDS, ENGRAM_VOCAB, MAX_NGRAM, N_HEADS, HEAD_DIM, PAD_TOKEN = (1, 4), 40, 4, 2, 32, 2


@pytest.fixture(scope="module")
def reference() -> dict:
    data = json.loads(REFERENCE.read_text())
    return {"prompt": data["prompts"][0], **data["engram"]}


@pytest.fixture(scope="module")
def token_map() -> tuple[np.ndarray, int]:
    return compressed_token_map(tokenizers.Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json")))


@pytest.fixture(scope="module")
def layout(token_map) -> engram.EngramLayout:
    ids, size = token_map
    return engram.EngramLayout.build(LAYER_IDS, ENGRAM_VOCAB, MAX_NGRAM, N_HEADS, HEAD_DIM, size)


@pytest.fixture(scope="module")
def table(layout, token_map) -> jax.Array:
    ids, _ = token_map
    return jnp.asarray(engram.product_table(layout, ids, int(ids[PAD_TOKEN])))


hash_ids = jax.jit(engram.hash_ids, static_argnums=3)


def test_compressed_map_matches_reference(reference, token_map):
    ids, size = token_map
    assert ids.dtype == np.int32
    assert size == reference["compressed_vocab_size"]
    assert ids.tolist() == reference["token_map"]
    # jaxserve's own Tokenizer is accepted as well (its backend is the same tokenizers.Tokenizer).
    ours, ours_size = compressed_token_map(Tokenizer(CHECKPOINT))
    assert ours_size == size and np.array_equal(ours, ids)


def test_layout_matches_reference(reference, layout):
    flat = [[p for per_ngram in layer for p in per_ngram] for layer in reference["primes"]]
    assert [list(p) for p in layout.primes] == flat
    assert [list(o) for o in layout.offsets] == reference["offsets"]
    assert [list(m) for m in layout.multipliers] == reference["multipliers"]
    assert list(layout.rows) == [sum(layer) for layer in flat]
    assert layout.n_cols == (MAX_NGRAM - 1) * N_HEADS
    assert all(m % 2 == 1 for row in layout.multipliers for m in row)
    hash(layout)  # static under jit: hashable


def test_primes_past_the_uint32_reduction_are_refused():
    with pytest.raises(ValueError, match="engram_vocab_size"):
        engram.EngramLayout.build((1, 2), (1 << 24) - 40, 4, 8, 256, 99092)
    # The released size (16,000,000, 2 layers x 3 n-gram sizes x 8 heads) stays well below 2^24.
    released = engram.EngramLayout.build((1, 14), 16_000_000, 4, 8, 256, 99092)
    assert max(max(p) for p in released.primes) < 1 << 24 and all(r < 1 << 31 for r in released.rows)


def test_product_table(layout, token_map, reference):
    ids, _ = token_map
    assert int(ids[PAD_TOKEN]) == reference["pad_id"]
    table = engram.product_table(layout, ids, int(ids[PAD_TOKEN]))
    assert table.shape == (len(ids) + 1, len(LAYER_IDS), MAX_NGRAM, 2) and table.dtype == np.uint32
    for token, compressed in [(0, int(ids[0])), (4095, int(ids[4095])), (len(ids), reference["pad_id"])]:
        for layer in range(len(LAYER_IDS)):
            for back in range(MAX_NGRAM):
                hi, lo = (int(v) for v in table[token, layer, back])
                assert (hi << 32) | lo == compressed * layout.multipliers[layer][back]


def _chunked(prompt: list[int], sizes: list[int], table, layout) -> np.ndarray:
    """hash_ids over the prompt in chunks of the given sizes (cycled), each with the tokens before it as context."""
    before = [-1] * (MAX_NGRAM - 1) + prompt
    out, pos, k = [], 0, 0
    while pos < len(prompt):
        size = min(sizes[k % len(sizes)], len(prompt) - pos)
        context = jnp.asarray([before[pos : pos + MAX_NGRAM - 1]], jnp.int32)
        out.append(np.asarray(hash_ids(context, jnp.asarray([prompt[pos : pos + size]], jnp.int32), table, layout)))
        pos, k = pos + size, k + 1
    return np.concatenate(out, axis=1)[0]


@pytest.mark.parametrize("sizes", [[100], [1], [3], [7], [1, 3, 7], [5, 64, 2]])
def test_hash_ids_match_reference(reference, table, layout, sizes):
    prompt = reference["prompt"]
    got = _chunked(prompt, sizes, table, layout)
    assert got.dtype == np.int32 and got.shape == (len(prompt), len(LAYER_IDS), layout.n_cols)
    assert got.tolist() == reference["hash_ids"]


def test_hash_ids_decode_step_and_batch_rows(reference, table, layout):
    """A decode-like chunk of one token with its three predecessors as context; and rows of a batch at different
    points of the prompt, one of them padded past its length (anything finite there)."""
    prompt, want = reference["prompt"], np.array(reference["hash_ids"])
    for p in (0, 1, 2, 3, 57, len(prompt) - 1):
        context = ([-1] * MAX_NGRAM + prompt)[p + 1 : p + MAX_NGRAM]
        got = hash_ids(jnp.asarray([context], jnp.int32), jnp.asarray([[prompt[p]]], jnp.int32), table, layout)
        assert np.array_equal(np.asarray(got)[0, 0], want[p])
    starts, t = [0, 10, 90], 8
    context = jnp.asarray([([-1] * MAX_NGRAM + prompt)[s + 1 : s + MAX_NGRAM] for s in starts], jnp.int32)
    tokens = [(prompt[s : s + t] + [7] * t)[:t] for s in starts]
    got = np.asarray(hash_ids(context, jnp.asarray(tokens, jnp.int32), table, layout))
    for row, s in enumerate(starts):
        n = min(t, len(prompt) - s)
        assert np.array_equal(got[row, :n], want[s : s + n])


def test_dead_token_stops_the_look_back(reference, table, layout):
    """A negative id in the chunk (a position kept out of n-grams): the positions after it hash as if the sequence
    started right after it, and it hashes as all pad."""
    prompt = reference["prompt"][:12]
    start = jnp.full((1, MAX_NGRAM - 1), -1, jnp.int32)
    dead = 5
    with_dead = np.asarray(hash_ids(start, jnp.asarray([prompt[:dead] + [-1] + prompt[dead + 1 :]]), table, layout))
    fresh = np.asarray(hash_ids(start, jnp.asarray([prompt[dead + 1 :]]), table, layout))
    assert np.array_equal(with_dead[0, dead + 1 : dead + MAX_NGRAM], fresh[0, : MAX_NGRAM - 1])
    assert np.array_equal(with_dead[0, dead + MAX_NGRAM :], np.asarray(_chunked(prompt, [12], table, layout))[9:])
    all_pad = np.asarray(hash_ids(start, jnp.asarray([[-1]]), table, layout))
    pad_product = [reference["pad_id"] * m for m in layout.multipliers[0]]
    xor = [pad_product[0]]
    for p in pad_product[1:]:
        xor.append(xor[-1] ^ p)
    expect = [
        xor[n] % q + o for n, q, o in zip(np.repeat(range(1, MAX_NGRAM), N_HEADS), layout.primes[0], layout.offsets[0])
    ]
    assert all_pad[0, 0, 0].tolist() == expect


def _small_primes_below(limit: int, count: int) -> list[int]:
    found: list[int] = []
    n = limit - 1
    while len(found) < count:
        if n % 2 and all(n % d for d in range(3, int(n**0.5) + 1, 2)):
            found.append(n)
        n -= 1
    return found


def test_uint32_modular_reduction_matches_big_ints():
    rng = random.Random(0)
    moduli = _small_primes_below(1 << 24, 6) + [rng.randrange(2, 1 << 24) for _ in range(10)] + [2, 3, 41, 65537]
    values = [rng.getrandbits(64) for _ in range(400)] + [0, 1, (1 << 64) - 1, (1 << 63) - 1, 1 << 32, (1 << 32) - 1]
    hi = jnp.asarray([v >> 32 for v in values], jnp.uint32)[:, None]
    lo = jnp.asarray([v & 0xFFFFFFFF for v in values], jnp.uint32)[:, None]
    got = np.asarray(jax.jit(engram.mod_u64)(hi, lo, jnp.asarray(moduli, jnp.uint32)[None, :]))
    assert got.dtype == np.uint32
    assert got.tolist() == [[v % m for m in moduli] for v in values]


def test_lookup_decodes_fp8_rows():
    rng = np.random.default_rng(0)
    rows, k = 50, 64
    codes = (rng.standard_normal((rows, k)) * 30).astype(ml_dtypes.float8_e4m3fn)
    scales = rng.integers(100, 150, (rows, k // 32)).astype(np.uint8)
    ids = rng.integers(0, rows, (3, 5, 4))
    got = np.asarray(engram.lookup(jnp.asarray(codes)[ids], jnp.asarray(scales)[ids]))
    decoded = codes.astype(np.float64) * np.repeat(2.0 ** (scales.astype(np.float64) - 127), 32, axis=-1)
    assert got.dtype == np.float32 and got.shape == (3, 5, 4, k)
    assert np.array_equal(got, decoded[ids])  # exact: an e4m3 code times a power of two


def _gates(got: np.ndarray, streams: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Each stream's gate, read off the mix: how far it moved along the value."""
    delta = got.astype(np.float64) - streams
    return (delta * value).sum(-1) / (value**2).sum(-1)


@pytest.mark.parametrize("eps", [1e-6, 1e-20])
def test_engram_mix(eps):
    """The mix's properties (its numbers are transformers' own: tests/test_v41.py serves the Engram layers against
    the reference's logprobs)."""
    rng = np.random.default_rng(1)
    b, t, h, d, c, k = 2, 5, 4, 64, 6, 32
    inputs = [
        (rng.standard_normal((b, t, h, d)) * 3).astype(np.float32),  # streams
        rng.standard_normal((b, t, c, k)).astype(np.float32),  # rows
        (rng.standard_normal((c * k, d * (h + 1))) * 0.05).astype(np.float32),  # wkv
        (1 + 0.2 * rng.standard_normal((h, d))).astype(np.float32),  # q_weight
        (1 + 0.2 * rng.standard_normal((h, d))).astype(np.float32),  # k_weight
    ]
    streams, rows, wkv, q_weight, k_weight = inputs
    mask = rng.random((b, t)) > 0.3
    mix = jax.jit(engram.engram_mix, static_argnums=4)
    projected = jnp.asarray(rows.reshape(b, t, -1)) @ jnp.asarray(wkv)
    qw, kw = jnp.asarray(q_weight), jnp.asarray(k_weight)
    got = np.asarray(mix(jnp.asarray(streams), projected, qw, kw, eps, jnp.asarray(mask)))
    assert got.dtype == np.float32
    value = np.asarray(projected, np.float64)[:, :, None, h * d :]
    gate = _gates(got, streams, value)
    # The gate is a sigmoid of a signed root of a normalized dot product: a stream scaled keeps its gate, and the
    # keys negated give each stream the complementary gate.
    scaled = np.asarray(mix(jnp.asarray(streams * 8), projected, qw, kw, eps, jnp.asarray(mask)))
    np.testing.assert_allclose(_gates(scaled, streams * 8, value)[mask], gate[mask], atol=1e-5)
    negated = projected.at[..., : h * d].multiply(-1)
    flipped = np.asarray(mix(jnp.asarray(streams), negated, qw, kw, eps, jnp.asarray(mask)))
    np.testing.assert_allclose(_gates(flipped, streams, value)[mask], 1 - gate[mask], atol=1e-5)
    assert np.any(gate[mask] > 0.6) and np.any(gate[mask] < 0.4)  # the random keys agree with some streams only
    # Masked positions pass through bit for bit; elsewhere each stream moves along the value by a gate in (0, 1).
    assert np.array_equal(got[~mask], streams[~mask])
    delta = got.astype(np.float64) - streams
    assert np.all((gate[mask] > 0) & (gate[mask] < 1))
    np.testing.assert_allclose(delta[mask], (gate[..., None] * value)[mask], atol=1e-3)
    # No mask: every position mixes; bfloat16 streams come back as bfloat16.
    unmasked = engram.engram_mix(jnp.asarray(streams).astype(jnp.bfloat16), projected, qw, kw, eps)
    assert unmasked.dtype == jnp.bfloat16
    assert not np.array_equal(np.asarray(unmasked, np.float32)[~mask], streams[~mask])
