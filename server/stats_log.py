"""The periodic throughput line (vLLM's "Avg prompt throughput ..."), every `log_stats_interval` seconds while the
engine is busy, silent while it is idle."""

from __future__ import annotations

import asyncio
import logging
import time

from jaxserve.config import STEP_POLICIES
from jaxserve.engine import Engine, EngineStats
from jaxserve.request.step import StepKind

log = logging.getLogger("jaxserve.stats")


def stats_line(before: EngineStats, after: EngineStats, seconds: float) -> str | None:
    """The line for one interval between two `engine.stats()` snapshots, or None if nothing happened in it."""
    steps = {kind: after.steps.by_kind[kind] - before.steps.by_kind[kind] for kind in StepKind}
    forced = {name: after.steps.forced[name] - before.steps.forced[name] for name in STEP_POLICIES}
    prompt, generated = after.prompt_tokens - before.prompt_tokens, after.generation_tokens - before.generation_tokens
    if not (prompt or generated or any(steps.values()) or after.running or after.waiting):
        return None
    return (
        f"Avg prompt throughput: {prompt / seconds:.1f} tok/s, "
        f"Avg generation throughput: {generated / seconds:.1f} tok/s, "
        f"Running: {after.running} reqs ({after.prefilling} prefilling), Waiting: {after.waiting} reqs, "
        f"KV cache usage: {after.kv_usage:.1%}, "
        f"Steps: {steps[StepKind.PREFILL]} prefill, {steps[StepKind.MIXED]} mixed, {steps[StepKind.DECODE]} "
        f"decode ({', '.join(f'{forced[name]} {STEP_POLICIES[name].forced_words}' for name in STEP_POLICIES)})"
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
