"""The periodic throughput line (vLLM's "Avg prompt throughput ..."), every `log_stats_interval` seconds while the
engine is busy, silent while it is idle."""

from __future__ import annotations

import asyncio
import logging
import time

from jaxserve.engine import Engine

log = logging.getLogger("jaxserve.stats")


def stats_line(before: dict, after: dict, seconds: float) -> str | None:
    """The line for one interval between two `engine.stats()` snapshots, or None if nothing happened in it."""
    delta = {key: after[key] - before[key] for key in
             ("prompt_tokens", "generation_tokens", "prefill_steps", "decode_steps", "forced_decode_steps")}
    if not any(delta.values()) and not after["running"] and not after["waiting"]:
        return None
    return (f"Avg prompt throughput: {delta['prompt_tokens'] / seconds:.1f} tok/s, "
            f"Avg generation throughput: {delta['generation_tokens'] / seconds:.1f} tok/s, "
            f"Running: {after['running']} reqs, Waiting: {after['waiting']} reqs, "
            f"KV cache usage: {after['kv_usage']:.1%}, "
            f"Steps: {delta['prefill_steps']} prefill, {delta['decode_steps']} decode "
            f"({delta['forced_decode_steps']} interleaved)")


async def log_stats_forever(engine: Engine, interval: float) -> None:
    before, started = engine.stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        after, now = engine.stats(), time.monotonic()
        line = stats_line(before, after, now - started)
        if line is not None:
            log.info(line)
        before, started = after, now
