"""The one place a Scheduler is put together from the flags: its managers, its step policies and its queue order."""

from __future__ import annotations

from jaxserve.config import SCHEDULING_POLICIES, EngineConfig
from jaxserve.scheduler.allocator import IdAllocator
from jaxserve.scheduler.decode import DecodeManager
from jaxserve.scheduler.policies import step_policies
from jaxserve.scheduler.policy import PolicyContext
from jaxserve.scheduler.prefill import PrefillManager
from jaxserve.scheduler.prefix_cache import PrefixCache
from jaxserve.scheduler.scheduler import Scheduler


def build_scheduler(cfg: EngineConfig, pages: PrefixCache, page_size: int, min_chunk_tokens: int) -> Scheduler:
    prefill = PrefillManager(
        pages,
        page_size,
        cfg.chunked_prefill_size,
        cfg.max_prefill_rows,
        IdAllocator(cfg.max_num_seqs, "slots"),
        SCHEDULING_POLICIES[cfg.scheduling_policy](),
    )
    return Scheduler(
        prefill,
        DecodeManager(cfg.max_num_seqs, cfg.draft_tokens),
        step_policies(cfg, PolicyContext(page_size, min_chunk_tokens)),
    )
