"""Shared helpers for the benchmark scripts: JAX set-up on CPU (call `configure_jax` before anything imports
jax), alternating timers with medians, cache geometries, runners, and result files (JSON + markdown).

Timings on a shared 2-core machine are noisy: every script measures the things it compares in the same
process, alternating them, and reports medians and ratios, with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # jaxserve is imported lazily: these helpers must load before configure_jax() sets JAX up
    from jaxserve.request import Request

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
COMPILE_CACHE = Path.home() / ".cache" / "jaxserve" / "xla-bench"


def configure_jax(devices: int = 1, compile_cache: bool = True) -> None:
    """CPU backend with `devices` fake host devices and a persistent compile cache (JAXSERVE_BENCH_PLATFORM=gpu: the
    accelerator instead, for the scripts that say they run there). Must run before jax is imported (XLA reads the
    device count once)."""
    if "jax" in sys.modules:
        raise RuntimeError("configure_jax must run before jax is imported")
    os.environ["JAX_PLATFORMS"] = os.environ.get("JAXSERVE_BENCH_PLATFORM", "cpu")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from jaxserve.runner.targets import tune_xla_cpu

    tune_xla_cpu()  # in-process steps compile as `jaxserve`'s do (cli.main)
    import jax

    if compile_cache:
        jax.config.update("jax_compilation_cache_dir", str(COMPILE_CACHE))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def machine_info() -> dict[str, Any]:
    import jax

    return {
        "cpu_cores": cpu_cores(),
        "jax": jax.__version__,
        "jax_devices": len(jax.devices()),
        "load_average_1min_at_start": load_average(),
    }


# ---- timing ---------------------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of `fn` takes (fn must block until its result is ready)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(fns: dict[str, Callable[[], Any]], repeats: int, calls: int = 1) -> dict[str, list[float]]:
    """Run each fn `calls` times per round, the fns interleaved round after round; seconds per call."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(lambda fn=fn: [fn() for _ in range(calls)]) / calls)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of a list of seconds, in milliseconds."""
    return {
        "median_ms": round(1e3 * median(values), 3),
        "min_ms": round(1e3 * min(values), 3),
        "max_ms": round(1e3 * max(values), 3),
        "n": len(values),
    }


# ---- profiling ----------------------------------------------------------------------------------------------------


def trace_calls(fn: Callable[[], Any], calls: int) -> list[dict[str, Any]]:
    """The complete ('X') events of a jax.profiler trace of `calls` calls of fn."""
    import glob
    import gzip
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for _ in range(calls):
                fn()
        (path,) = glob.glob(f"{folder}/plugins/profile/*/*.trace.json.gz")
        events = json.load(gzip.open(path))["traceEvents"]
    return [e for e in events if e.get("ph") == "X"]


def op_time_by_scope(events: list[dict[str, Any]], hlo_text: str, calls: int, depth: int = 3, top: int = 20) -> str:
    """Sum XLA:CPU op time per `jax.named_scope` path (layer numbers folded), as a markdown table.

    The trace names ops by their HLO instruction names; the compiled module's text maps those to the op_name
    metadata (scope path). Op time excludes the executor's per-op dispatch, so it is less than the wall time.
    """
    import re

    scope_of = {}
    for line in hlo_text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%(\S+) = .*?metadata=\{op_name=\"([^\"]*)\"", line)
        if found:
            # Fold the layers: drop the segment and layer-kind scopes (ops inside a scan body carry no jit prefix).
            path = re.sub(r"^jit\([^)]*\)/|segment_\d+/|(?:swa|csa|hca)(?:_hash)?/|while/body/", "", found.group(2))
            scope_of[found.group(1)] = "/".join(path.split("/")[:depth])
    totals: dict[str, float] = {}
    for event in events:
        name = event["name"]
        if name in scope_of:
            key = scope_of[name]
        elif re.fullmatch(r"[a-z][a-z0-9_\-]*(\.\d+)?", name):  # an HLO instruction without scope metadata
            key = "(no scope) " + name.split(".")[0]
        else:
            continue
        totals[key] = totals.get(key, 0.0) + event["dur"] / 1e3 / calls
    whole = sum(totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    rows = [[scope, f"{ms:.3f}", f"{100 * ms / whole:.1f}%"] for scope, ms in ranked]
    table = markdown_table(["scope (layers folded)", "ms per call", "share"], rows)
    return f"{table}\n\nop time in all: {whole:.2f} ms"


# ---- model set-up ------------------------------------------------------------------------------------------------


def geometry(cfg, slots: int, max_tokens: int, spare_pages: int = 1):
    """Pages of lcm(compress rates) tokens; room for `max_tokens` per slot, every slot's pages disjoint."""
    from jaxserve.model.cache import CacheGeometry
    from jaxserve.paging import pages_needed

    rates = [cfg.compress_rate(i) for i in cfg.compressed_layers] or [1]
    page_size = math.lcm(*rates)
    per_seq = pages_needed(max_tokens, page_size)
    return CacheGeometry(
        num_slots=slots, num_pages=slots * per_seq + spare_pages, page_size=page_size, max_pages_per_seq=per_seq
    )


def slot_pages(geo, slot: int) -> list[int]:
    """The pages of `slot` under `geometry()`: a contiguous block, page 0 left unused."""
    n = geo.max_pages_per_seq
    return list(range(1 + slot * n, 1 + (slot + 1) * n))


def slot_request(geo, slot: int, prompt, output=()) -> Request:
    """A greedy request record in `slot` with its `slot_pages`, as the scheduler would hand it to the runner."""
    from jaxserve.request import Request, SamplingParams

    return Request(
        f"slot{slot}",
        list(map(int, prompt)),
        SamplingParams(temperature=0.0),
        output_ids=list(output),
        num_sampled=len(output),
        slot=slot,
        pages=slot_pages(geo, slot),
    )


def prefill_step(runner, request, start: int, length: int) -> int:
    """Run one chunk of `request`'s prompt; the token sampled after it."""
    from jaxserve.request.batch import StepBatch
    from jaxserve.request.step import StepPlan, StepRow

    row = StepRow.chunk(request, start, length)
    token = runner.run(StepBatch.of(StepPlan(prefill=(row,)))).prefill[0].token_id
    request.num_sampled += row.samples_output  # what scheduling the step records
    return token


def decode_step(runner, requests) -> None:
    """One decode step over `requests`; each gets its next token appended."""
    from jaxserve.request.batch import StepBatch
    from jaxserve.request.step import StepPlan

    for request, out in zip(requests, runner.run(StepBatch.of(StepPlan.decode_of(requests))).decode):
        request.output_ids.append(out.token_id)
        request.num_sampled += 1  # what scheduling the step records


def add_kernels_flag(parser: argparse.ArgumentParser) -> None:
    """--kernels, as `jaxserve serve` has it (jaxserve.kernels.table)."""
    from jaxserve.kernels.table import KERNEL_CHOICES

    parser.add_argument(
        "--kernels",
        choices=KERNEL_CHOICES,
        default="auto",
        help="implementations of the kernel-worthy operations (default: %(default)s)",
    )


def make_runner(
    cfg,
    weights,
    geo,
    mesh,
    prefill_chunks: tuple[int, ...],
    decode_rows: tuple[int, ...],
    kernels: str = "auto",
    batch_invariant: bool = False,
):
    """A ModelRunner with `weights` placed on `mesh`, every bucket compiled; returns (runner, compile seconds)."""
    from jaxserve.model.sharding import place
    from jaxserve.model.weights import abstract_weights
    from jaxserve.runner import Buckets, ModelRunner

    placed = place(weights, abstract_weights(cfg), mesh)
    runner = ModelRunner(
        cfg,
        placed,
        geo,
        mesh,
        Buckets(prefill_rows=(1,), prefill_chunks=prefill_chunks, decode_rows=decode_rows),
        kernels=kernels,
        batch_invariant=batch_invariant,
    )
    return runner, timed(runner.warmup)


# ---- output ------------------------------------------------------------------------------------------------------


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.1f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(name: str, data: Any, markdown: str) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path, md_path = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path
