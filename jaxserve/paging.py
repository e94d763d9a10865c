"""KV page arithmetic, shared by the host's page accounting (the scheduler's prefix cache and allocator) and the
device cache's geometry (jaxserve.model.cache), so neither reaches into the other for it."""

from __future__ import annotations


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages of `page_size` tokens that hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)
