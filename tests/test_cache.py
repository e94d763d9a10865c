"""KV cache layout and the host page allocator."""

from __future__ import annotations

import pytest

from jaxserve.cache import CacheGeometry, PagePool, PagePoolExhausted, abstract_cache, bytes_per_token, cache_nbytes
from jaxserve.presets import preset


def test_page_pool_allocates_frees_and_refuses_cleanly():
    pool = PagePool(8)
    a = pool.allocate(5)
    assert len(set(a)) == 5 and pool.num_free == 3
    with pytest.raises(PagePoolExhausted, match="asked for 4 KV pages but only 3 of 8 are free"):
        pool.allocate(4)
    assert pool.num_free == 3 and pool.num_used == 5  # the failed call changed nothing
    b = pool.allocate(3)
    assert not set(a) & set(b) and pool.num_free == 0
    pool.free(a)
    assert pool.num_free == 5
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[0]])  # double free
    pool.free(b)
    assert pool.num_free == 8 and pool.num_used == 0


def test_flash_bytes_per_token_matches_the_spec():
    cfg = preset("flash", dtype="bfloat16")
    # dsv4-model.md 6.3: 21 CSA layers x 320 B + 20 HCA layers x 8 B = 6880 B per token.
    assert bytes_per_token(cfg) == 21 * 320 + 20 * 8
    geo = CacheGeometry(num_slots=1, num_pages=1024, page_size=128, max_pages_per_seq=1024)
    sizes = cache_nbytes(cfg, geo)
    assert sizes["paged"] == 1024 * 128 * (21 * 320 + 20 * 8)


def test_page_size_must_cover_every_compress_rate():
    with pytest.raises(ValueError, match="page_size=64: must be a multiple of 128"):
        abstract_cache(preset("flash"), CacheGeometry(num_slots=1, num_pages=4, page_size=64, max_pages_per_seq=4))
