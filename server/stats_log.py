"""The periodic throughput line (vLLM's "Avg prompt throughput ..."), every `log_stats_interval` seconds while the
engine is busy, silent while it is idle."""

from __future__ import annotations

import asyncio
import logging
import time

from jaxserve.engine import Engine, EngineStats
from jaxserve.request.step import ForcedBy, StepKind

log = logging.getLogger("jaxserve.stats")


def stats_line(before: EngineStats, after: EngineStats, seconds: float) -> str | None:
    """The line for one interval between two `engine.stats()` snapshots, or None if nothing happened in it."""
    steps = {kind: after.steps.by_kind[kind] - before.steps.by_kind[kind] for kind in StepKind}
    forced = {policy: after.steps.forced[policy] - before.steps.forced[policy] for policy in ForcedBy}
    prompt, generated = after.prompt_tokens - before.prompt_tokens, after.generation_tokens - before.generation_tokens
    if not (prompt or generated or any(steps.values()) or after.running or after.waiting):
        return None
    return (
        f"Avg prompt throughput: {prompt / seconds:.1f} tok/s, "
        f"Avg generation throughput: {generated / seconds:.1f} tok/s, "
        f"Running: {after.running} reqs ({after.prefilling} prefilling), Waiting: {after.waiting} reqs, "
        f"KV cache usage: {after.kv_usage:.1%}, "
        f"Steps: {steps[StepKind.PREFILL]} prefill, {steps[StepKind.MIXED]} mixed, {steps[StepKind.DECODE]} "
        f"decode ({forced[ForcedBy.INTERLEAVE]} interleaved, {forced[ForcedBy.STALL]} for the stall budget)"
    )


async def log_stats_forever(engine: Engine, interval: float) -> None:
    before, started = engine.stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        after, now = engine.stats(), time.monotonic()
        line = stats_line(before, after, now - started)
        if line is not None:
            log.info(line)
        before, started = after, now
