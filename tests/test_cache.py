"""KV cache layout and sizes (the host page allocator is tested in test_managers.py)."""

from __future__ import annotations

import pytest

from jaxserve.model.cache import CacheGeometry, abstract_cache, bytes_per_token, cache_nbytes
from jaxserve.presets import preset


def test_flash_bytes_per_token_matches_the_spec():
    cfg = preset("flash", dtype="bfloat16")
    # By hand: 21 CSA layers x 320 B + 20 HCA layers x 8 B = 6880 B per token.
    assert bytes_per_token(cfg) == 21 * 320 + 20 * 8
    geo = CacheGeometry(num_slots=1, num_pages=1024, page_size=128, max_pages_per_seq=1024)
    sizes = cache_nbytes(cfg, geo)
    assert sizes["paged"] == 1024 * 128 * (21 * 320 + 20 * 8)


def test_flash_fp8_bytes_per_token_count_codes_scales_and_rope_dims():
    cfg = preset("flash", dtype="bfloat16")
    nope, rope, index = cfg.head_dim - cfg.rope_head_dim, cfg.rope_head_dim, cfg.index_head_dim
    assert (nope, rope, index, cfg.csa_rate, cfg.hca_rate) == (448, 64, 128, 4, 128)
    # By hand: a K=V entry is 448 e4m3 bytes + 7 ue8m0 scale bytes (one per 64 dims) + 64 bf16 RoPE dims = 583 B,
    # an indexer key 128 e4m3 bytes + a float32 scale = 132 B; per token, a CSA layer adds (583 + 132) / 4 B and
    # an HCA layer 583 / 128 B.
    entry, key = nope + nope // 64 + 2 * rope, index + 4
    assert (entry, key) == (583, 132)
    per_token = 21 * (entry + key) / 4 + 20 * entry / 128
    assert bytes_per_token(cfg, "fp8") == per_token == 3844.84375
    assert per_token < 0.56 * bytes_per_token(cfg, "bfloat16")
    geo = CacheGeometry(num_slots=1, num_pages=1024, page_size=128, max_pages_per_seq=1024, kv_cache_dtype="fp8")
    assert cache_nbytes(cfg, geo)["paged"] == 1024 * 128 * per_token


def test_page_size_must_cover_every_compress_rate():
    with pytest.raises(ValueError, match="page_size=64: must be a multiple of 128"):
        abstract_cache(preset("flash"), CacheGeometry(num_slots=1, num_pages=4, page_size=64, max_pages_per_seq=4))
