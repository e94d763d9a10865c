"""Progress of long start-up loops (weights, step compiles): a bar redrawn in place on a terminal; in a log (stdout
not a terminal) a few plain lines instead, at every quarter and at the end, so log files get no carriage
returns and no thousand-line walls."""

from __future__ import annotations

import sys
import time

BAR_WIDTH = 30
LOG_STEPS = 4  # plain lines per loop when stdout is not a terminal


def progress(label: str, done: int, total: int, started: float, detail: str = "") -> None:
    """Report `done` of `total` items, `started` being the loop's time.perf_counter() at its start."""
    elapsed = time.perf_counter() - started
    suffix = f" {detail}" if detail else ""
    if sys.stdout.isatty():
        filled = BAR_WIDTH * done // total
        print(
            f"\r{label} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} {elapsed:5.1f}s{suffix}\033[K",
            end="" if done < total else "\n",
            flush=True,
        )
    elif done == total or done * LOG_STEPS // total > (done - 1) * LOG_STEPS // total:
        print(f"{label}: {done}/{total} ({100 * done // total}%) in {elapsed:.1f} s{suffix}", flush=True)
