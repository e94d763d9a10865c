"""The FP8 KV cache (`--kv-cache-dtype fp8`): the block quantization of jaxserve.kernels.kv_quant (its error bound,
power-of-two scales, RoPE dims kept exactly, each scale on its own block)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.kv_quant import Fp8KV, dequantize_kv, quantize_kv

E4M3_REL = 2.0 ** -4  # half an ulp of a 3-bit mantissa, relative to the value
E4M3_SUBNORMAL_ABS = 2.0 ** -10  # half the subnormal step (2^-9), relative to the block's scale


def _blocky(shape: tuple[int, ...], block: int, seed: int = 0) -> np.ndarray:
    """Normal values whose magnitude changes 4x or more from block to block, along the vectors and across them."""
    rows, width = shape
    magnitude = 4.0 ** ((np.arange(rows)[:, None] + 2 * (np.arange(width)[None, :] // block)) % 5 - 2)
    return (np.random.default_rng(seed).normal(size=shape) * magnitude).astype(np.float32)


def _block_amax(x: np.ndarray, block: int) -> np.ndarray:
    return np.abs(x).reshape(*x.shape[:-1], -1, block).max(-1)


def _worst_block_error(got, want: np.ndarray, block: int) -> float:
    """max over blocks of (max |error| in the block / the block's amax)."""
    err = np.abs(np.asarray(got, np.float32) - want)
    return float((_block_amax(err, block) / _block_amax(want, block)).max())


def test_round_trip_is_within_e4m3_rounding_scales_are_the_smallest_fitting_powers_of_two_and_rope_is_exact():
    block, rope = 64, 8
    x = _blocky((6, 2 * block + rope), block)
    with pytest.raises(ValueError, match="a block of 48 does not divide the 128 quantized dims"):
        quantize_kv(jnp.asarray(x), 48, rope, jnp.uint8)
    q = quantize_kv(jnp.asarray(x), block, rope, jnp.uint8)
    assert (q.codes.dtype, q.scales.dtype, q.rope.dtype) == (jnp.float8_e4m3fn, jnp.uint8, jnp.bfloat16)
    assert (q.codes.shape, q.scales.shape, q.rope.shape, q.block, q.shape) == ((6, 128), (6, 2), (6, 8), 64, x.shape)
    nope = x[:, :2 * block]
    scale = 2.0 ** (np.asarray(q.scales, np.float64) - 127)
    amax = _block_amax(nope, block)
    assert ((amax / 448 <= scale) & (scale < 2 * amax / 448)).all()  # the smallest power of two that fits

    got = np.asarray(dequantize_kv(q, jnp.float32))
    bound = E4M3_REL * np.abs(nope) + E4M3_SUBNORMAL_ABS * np.repeat(scale, block, axis=-1)
    assert (np.abs(got[:, :2 * block] - nope) <= bound).all()
    assert _worst_block_error(got[:, :2 * block], nope, block) <= E4M3_REL
    np.testing.assert_array_equal(got[:, 2 * block:], np.asarray(jnp.asarray(x[:, 2 * block:], jnp.bfloat16),
                                                                 np.float32))
    # Codes times a power of two are exact in bfloat16: decoding there loses nothing.
    np.testing.assert_array_equal(np.asarray(dequantize_kv(q, jnp.bfloat16), np.float32), got)


def test_indexer_form_quantizes_every_dim_with_one_float32_power_of_two_per_key():
    x = _blocky((6, 32), 8, seed=1)
    q = quantize_kv(jnp.asarray(x), 32, 0, jnp.float32)
    assert q.rope is None and q.scales.shape == (6, 1) and q.scales.dtype == jnp.float32
    mantissa, _ = np.frexp(np.asarray(q.scales))
    assert (mantissa == 0.5).all()
    assert _worst_block_error(dequantize_kv(q, jnp.float32), x, 32) <= E4M3_REL


def test_each_scale_decodes_its_own_block_and_a_misplaced_scale_is_far_off():
    """Blocks 4x or more apart in magnitude, along the vector and across vectors: the decoded values are within
    e4m3's bound only with each scale on its own block. The same decoder given the scales shifted by one block,
    or by one vector, is off by most of the blocks' magnitude, so this data tells a misapplied scale apart."""
    block = 16
    x = _blocky((5, 4 * block), block, seed=2)
    q = quantize_kv(jnp.asarray(x), block, 0, jnp.uint8)
    assert _worst_block_error(dequantize_kv(q, jnp.float32), x, block) <= E4M3_REL
    for axis in (-1, 0):
        shifted = Fp8KV(q.codes, jnp.roll(q.scales, 1, axis=axis))
        assert _worst_block_error(dequantize_kv(shifted, jnp.float32), x, block) > 0.7, axis
