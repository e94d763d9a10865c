"""KV cache layout and sizes (the host page allocator is tested in test_managers.py)."""

from __future__ import annotations

import pytest

from jaxserve.cache import CacheGeometry, abstract_cache, bytes_per_token, cache_nbytes
from jaxserve.presets import preset


def test_flash_bytes_per_token_matches_the_spec():
    cfg = preset("flash", dtype="bfloat16")
    # By hand: 21 CSA layers x 320 B + 20 HCA layers x 8 B = 6880 B per token.
    assert bytes_per_token(cfg) == 21 * 320 + 20 * 8
    geo = CacheGeometry(num_slots=1, num_pages=1024, page_size=128, max_pages_per_seq=1024)
    sizes = cache_nbytes(cfg, geo)
    assert sizes["paged"] == 1024 * 128 * (21 * 320 + 20 * 8)


def test_page_size_must_cover_every_compress_rate():
    with pytest.raises(ValueError, match="page_size=64: must be a multiple of 128"):
        abstract_cache(preset("flash"), CacheGeometry(num_slots=1, num_pages=4, page_size=64, max_pages_per_seq=4))
