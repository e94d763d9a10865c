"""The one place the scheduling flags become a Scheduler: its step policies, in the order they are asked, and its
queue order (docs/scheduling.md)."""

from __future__ import annotations

from jaxserve.config import EngineConfig
from jaxserve.scheduler.allocator import IdAllocator
from jaxserve.scheduler.decode import DecodeManager
from jaxserve.scheduler.interleave import DecodeInterleavePolicy
from jaxserve.scheduler.policy import MixedSteps, StepPolicy
from jaxserve.scheduler.prefill import PrefillManager
from jaxserve.scheduler.queue_order import QUEUE_ORDERS, QueueOrder
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.scheduler.stall import DecodeStallPolicy


def step_policies(cfg: EngineConfig, page_size: int, min_chunk_tokens: int) -> list[StepPolicy]:
    """The configured policies, in the order they are asked (the interleave count before the stall budget)."""
    policies: list[StepPolicy] = []
    if cfg.interleave_every is not None:
        policies.append(DecodeInterleavePolicy(cfg.interleave_every))
    if cfg.stall_budget_ms is not None:
        policies.append(DecodeStallPolicy(cfg.stall_budget_ms, page_size=page_size, min_chunk_tokens=min_chunk_tokens))
    if cfg.mixed_steps:
        policies.append(MixedSteps())
    return policies


def queue_order(cfg: EngineConfig) -> QueueOrder:
    return QUEUE_ORDERS[cfg.scheduling_policy]()


def build_scheduler(cfg: EngineConfig, page_pool: IdAllocator, page_size: int, min_chunk_tokens: int) -> Scheduler:
    prefill = PrefillManager(page_pool, page_size, cfg.chunked_prefill_size, cfg.max_prefill_rows,
                             IdAllocator(cfg.max_num_seqs, "slots"), queue_order(cfg))
    return Scheduler(prefill, DecodeManager(cfg.max_num_seqs), step_policies(cfg, page_size, min_chunk_tokens))
