"""Prefill/decode disaggregation end to end: the many-streams workload and the starvation experiment, PD vs colocated.

Rows (every engine server has the same engine flags: streams.py's, `--max-num-seqs 16 --dtype float32
--chunked-prefill-size 256`, the default prefill rows and scheduling, a --max-model-len that holds both workloads):
- `colocated`: one `jaxserve serve`, the default scheduling (mixed prefill steps);
- `pd`: one `jaxserve serve --disaggregation-mode prefill`, one `jaxserve serve --disaggregation-mode decode
  --decode-log-interval 1` (every decode step logged) and one `jaxserve router` in front of them, TP 1 each. The
  client talks to the router; the decode server asks the prefill server to prefill each prompt and pulls the state.

Workloads, each run once per row per round (rounds rotate the rows' order, so the machine's drift falls on both):
1. many streams: streams.py's workload and client (`run_workload`): 64 streamed completions of 32 tokens, prompts
   of 16-300 random words (new ones each round), 16 in flight. Per row: the inter-token gaps (consecutive chunks of
   one request, all requests together) median / p99 / max, TTFT (from sending) median and p99, generated tok/s (all
   tokens over the run's wall time).
2. starvation: interleave.py's experiment (`run_once`): a victim streams 1000 tokens of an 8-token prompt; after 30
   of them an attacker sends a prompt of 9.5 chunks (2432 tokens) asking for 3 tokens. Per row: the victim's max,
   p99 and median inter-token gap, its wall time, the attacker's TTFT and its prefill steps' seconds summed (from the
   log of the server that prefilled it).
The figures are medians over the rounds; `vs colocated` columns are medians of per-round ratios, minus 1.

Transfers (pd row, from the decode server's /metrics, counter deltas over each run): the bytes moved per request
(transfer_bytes / transfers: the state from the decode side's first missing page, page-bucket padding included), the
transfer time per request (transfer_seconds / transfers: from the prefill server's answer until the state arrived
and passed its checks), the prefill wait per request (prefill_wait_seconds / transfers: from asking the prefill server
until its answer: queueing there, prefill, first token), and the transfer's share of TTFT: mean transfer time per
request / the mean TTFT the client saw in the same run (the prefill wait's share the same way).

Decode steps while the prefill server is busy (pd row): each decode step the decode server logged (its duration and
the line's arrival, stamped here: the step is [arrival - duration, arrival]) is `busy` when it overlaps a prefill
step the prefill server logged the same way, else `idle`; median / p90 / p99 of the step durations of each class and
the mean requests a step decoded (a busy step may decode fewer: some requests wait for their state), pooled over the
rounds, per workload.

Read this with the machine in mind: it has 2 cores; the servers are pinned to one, the client and the router to the
other (as streams.py and interleave.py split them). The prefill and decode servers therefore share one core: the
kernel time-slices the two processes, so a decode step that overlaps a prefill step is slowed (the `busy` class shows
by how much) where a colocated server's prefill step holds every stream for the whole step (so the gaps can still
favour PD here), and PD adds the router hop, a second HTTP exchange and the state transfer to every request, and the
prefill server's work to the decode server's core (TTFT, tok/s). PD's real advantage, prefill and decode on devices
of their own so that a long prompt costs a stream nothing and a stream costs a prompt nothing, cannot show here.

    python benchmarks/pd.py            # 24 rounds, about 10 minutes on 2 CPU cores
    python benchmarks/pd.py --quick    # 1 round, 24 requests at concurrency 8, a 4.5-chunk attacker of a
                                       # 400-token victim
"""

from __future__ import annotations

import argparse
import os
import re
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import common
import httpx
import numpy as np
from common import RESULTS, cpu_cores, load_average, markdown_table, write_results
from interleave import Row, attacker_length, fmt, median, pct, run_once, split_cpus, token_prompt
from serving import Server, stream
from streams import (
    MAX_NUM_SEQS,
    add_workload_arguments,
    finish_workload_arguments,
    make_prompts,
    model_len_for,
    run_workload,
    workload_flags,
)

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.config import load_config

ROWS = ("colocated", "pd")
BASELINE = "colocated"
DECODE_LINE = re.compile(r"Decode batch(?: \([^)]*\))?: (\d+) requests.* ([0-9.]+) s$")
PREFILL_LINE = re.compile(r"Prefill batch(?: \(mixed\))?: (\d+) new tokens.* ([0-9.]+) s$")
METRIC_LINE = re.compile(r"^jaxserve:disaggregation_(\w+?)(?:_total)?\{[^}]*\} (\S+)$", re.M)
ROUTER_READY = "jaxserve router ready on "


# ---- the servers ----------------------------------------------------------------------------------------------


def start_router(prefill: str, decode: str, health_interval: float, cpus: set[int] | None) -> Server:
    """`jaxserve router` in front of one prefill and one decode server, once its /health answers 200 (a server of
    each role is healthy)."""
    flags = ["--prefill", prefill, "--decode", decode, "--health-check-interval", str(health_interval)]
    router = Server(flags, cpus, command="router", ready_line=ROUTER_READY)
    deadline = time.monotonic() + 60
    while router.proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(router.url + "/health", timeout=5).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    router.stop()
    raise RuntimeError("jaxserve router did not become healthy:\n" + "\n".join(line for _, line in router.lines[-30:]))


@dataclass
class Front:
    """What a workload's client talks to: `url`; `lines`: the log of the server that runs the prefill steps (the
    colocated server, or the prefill server), which streams' and interleave's step counts read."""

    url: str
    lines: list[tuple[float, str]]
    prefill: Server
    decode: Server | None = None  # pd: the decode server


def start_fronts(args: argparse.Namespace, server_cpus, client_cpus) -> tuple[dict[str, Front], list]:
    """Every row's processes, started one after another (each compiles every step shape before the next starts, so
    the later ones find the shapes in the persistent compile cache); (fronts, processes to stop)."""
    flags = workload_flags(args.chunk, args.max_model_len)
    processes: list = []
    fronts: dict[str, Front] = {}
    try:
        if "colocated" in args.rows:
            print("starting jaxserve serve (colocated)", flush=True)
            colocated = Server(flags, server_cpus)
            processes.append(colocated)
            fronts["colocated"] = Front(colocated.url, colocated.lines, colocated)
        if "pd" in args.rows:
            print("starting jaxserve serve --disaggregation-mode prefill", flush=True)
            prefill = Server([*flags, "--disaggregation-mode", "prefill"], server_cpus)
            processes.append(prefill)
            print("starting jaxserve serve --disaggregation-mode decode", flush=True)
            decode_flags = [*flags, "--disaggregation-mode", "decode", "--decode-log-interval", "1"]
            if args.checksum:
                decode_flags.append("--disaggregation-checksum")
            decode = Server(decode_flags, server_cpus)
            processes.append(decode)
            print("starting jaxserve router", flush=True)
            router = start_router(prefill.url, decode.url, args.health_check_interval, client_cpus)
            processes.append(router)
            fronts["pd"] = Front(router.url, prefill.lines, prefill, decode)
    except BaseException:
        stop_all(processes)
        raise
    return fronts, processes


def stop_all(processes: list) -> None:
    for process in reversed(processes):  # the router first
        process.stop()


def warm_up(front: Front, args: argparse.Namespace, vocab: int) -> None:
    """The HTTP path's first calls and one prompt of the attacker's length (the biggest state a transfer moves),
    outside the measurement."""
    stream(front.url, "warm up", 4, [])
    stream(front.url, token_prompt(attacker_length(args), 999, vocab), 3, [])


def transfer_counters(front: Front) -> dict[str, float]:
    """The decode server's disaggregation counters (pd only; {} for the colocated row)."""
    if front.decode is None:
        return {}
    text = httpx.get(front.decode.url + "/metrics", timeout=30).text
    return {name: float(value) for name, value in METRIC_LINE.findall(text)}


# ---- one run --------------------------------------------------------------------------------------------------


def steps(lines: list[tuple[float, str]], pattern: re.Pattern, since: float, until: float) -> list[tuple[float, ...]]:
    """(start, end, rows or tokens) of the steps matching `pattern` whose lines arrived in [since, until]: a line
    comes at its step's end and names its seconds."""
    return [
        (t - float(m.group(2)), t, int(m.group(1)))
        for t, line in list(lines)
        if since <= t <= until and (m := pattern.search(line))
    ]


@dataclass
class Measured:
    """One run of one workload on one row: the client's view (`run`: streams' or interleave's Run), the decode
    server's counter deltas and step classes (pd only)."""

    run: object
    ttft_mean: float
    counters: dict[str, float] = field(default_factory=dict)
    # (seconds, requests) of the decode steps that overlapped a prefill step (busy) or none (idle)
    busy_steps: list[tuple[float, int]] = field(default_factory=list)
    idle_steps: list[tuple[float, int]] = field(default_factory=list)


def measure(front: Front, work, ttfts) -> Measured:
    before, since = transfer_counters(front), time.perf_counter()
    run = work()
    until = time.perf_counter()  # the workloads wait 50 ms after their last token for the last step's line
    after = transfer_counters(front)
    measured = Measured(run, float(np.mean(ttfts(run))), {k: after[k] - before.get(k, 0.0) for k in after})
    if front.decode is not None:
        prefill = np.array(steps(front.prefill.lines, PREFILL_LINE, since, until + 1.0)).reshape(-1, 3)
        for start, end, rows in steps(front.decode.lines, DECODE_LINE, since, until):
            busy = bool(((prefill[:, 0] < end) & (prefill[:, 1] > start)).any())
            (measured.busy_steps if busy else measured.idle_steps).append((end - start, rows))
    return measured


def streams_run(front: Front, prompts: list[str], args: argparse.Namespace) -> Measured:
    return measure(front, lambda: run_workload(front, prompts, args), lambda run: run.ttfts)


def starvation_run(front: Front, args: argparse.Namespace, vocab: int, seed: int) -> Measured:
    row = Row("attacked", ())
    return measure(
        front,
        lambda: run_once(front, args, row, vocab, attack_seed=seed),
        lambda run: [run.victim_stamps[0] - run.start, run.attacker_ttft],
    )


# ---- summarising ----------------------------------------------------------------------------------------------


def over_rounds(runs: list[Measured], value) -> float | None:
    return median([value(m) for m in runs])


def paired(runs: list[Measured], base: list[Measured], value) -> float | None:
    """Median over rounds of value(this row's run) / value(the baseline's run of the same round) - 1."""
    return median([value(m) / value(b) - 1 for m, b in zip(runs, base)])


def gap_p99(m: Measured) -> float:
    return float(np.percentile(m.run.gaps, 99))


def ttft_p99(m: Measured) -> float:
    return float(np.percentile(m.run.ttfts, 99))


def streams_table(runs: dict[str, list[Measured]]) -> tuple[str, list[dict]]:
    base = runs.get(BASELINE)
    records = []
    for row, ms in runs.items():
        records.append(
            {
                "row": row,
                "gap_median_ms": 1e3 * over_rounds(ms, lambda m: float(np.median(m.run.gaps))),
                "gap_p99_ms": 1e3 * over_rounds(ms, gap_p99),
                "gap_max_ms": 1e3 * over_rounds(ms, lambda m: float(m.run.gaps.max())),
                "ttft_median_s": over_rounds(ms, lambda m: float(np.median(m.run.ttfts))),
                "ttft_p99_s": over_rounds(ms, ttft_p99),
                "gen_tok_s": over_rounds(ms, lambda m: m.run.gen_tok_s),
                "gap_p99_vs_colocated": paired(ms, base, gap_p99) if base else None,
                "ttft_p99_vs_colocated": paired(ms, base, ttft_p99) if base else None,
                "gen_tok_s_vs_colocated": paired(ms, base, lambda m: m.run.gen_tok_s) if base else None,
                "runs": len(ms),
            }
        )
    headers = ["row", "gap median ms", "gap p99 ms", "gap max ms", "TTFT median s", "TTFT p99 s", "gen tok/s"]
    headers += ["p99 gap vs colocated", "TTFT p99 vs colocated", "tok/s vs colocated"]
    rows = [
        [
            r["row"],
            fmt(r["gap_median_ms"], 1),
            fmt(r["gap_p99_ms"], 1),
            fmt(r["gap_max_ms"], 1),
            fmt(r["ttft_median_s"]),
            fmt(r["ttft_p99_s"]),
            fmt(r["gen_tok_s"], 1),
            pct(r["gap_p99_vs_colocated"]),
            pct(r["ttft_p99_vs_colocated"]),
            pct(r["gen_tok_s_vs_colocated"]),
        ]
        for r in records
    ]
    return markdown_table(headers, rows), records


def starvation_table(runs: dict[str, list[Measured]]) -> tuple[str, list[dict]]:
    base = runs.get(BASELINE)
    records = []
    for row, ms in runs.items():
        records.append(
            {
                "row": row,
                "victim_gap_max_ms": 1e3 * over_rounds(ms, lambda m: m.run.max_gap),
                "victim_gap_p99_ms": 1e3 * over_rounds(ms, gap_p99),
                "victim_gap_median_ms": 1e3 * over_rounds(ms, lambda m: m.run.pace),
                "victim_wall_s": over_rounds(ms, lambda m: m.run.victim_wall),
                "attacker_ttft_s": over_rounds(ms, lambda m: m.run.attacker_ttft),
                "attacker_prefill_s": over_rounds(ms, lambda m: m.run.attacker_prefill),
                "victim_gap_max_vs_colocated": paired(ms, base, lambda m: m.run.max_gap) if base else None,
                "attacker_ttft_vs_colocated": paired(ms, base, lambda m: m.run.attacker_ttft) if base else None,
                "runs": len(ms),
            }
        )
    headers = ["row", "victim max gap ms", "victim p99 gap ms", "victim median gap ms", "victim wall s"]
    headers += ["attacker TTFT s", "attacker prefill steps s", "max gap vs colocated", "attacker TTFT vs colocated"]
    rows = [
        [
            r["row"],
            fmt(r["victim_gap_max_ms"], 1),
            fmt(r["victim_gap_p99_ms"], 1),
            fmt(r["victim_gap_median_ms"], 1),
            fmt(r["victim_wall_s"]),
            fmt(r["attacker_ttft_s"], 3),
            fmt(r["attacker_prefill_s"], 3),
            pct(r["victim_gap_max_vs_colocated"]),
            pct(r["attacker_ttft_vs_colocated"]),
        ]
        for r in records
    ]
    return markdown_table(headers, rows), records


def transfer_table(pd: dict[str, list[Measured]]) -> tuple[str, list[dict]]:
    records = []
    for workload, ms in pd.items():

        def per_transfer(name: str, m: Measured) -> float | None:
            n = m.counters.get("transfers", 0.0)
            return m.counters.get(name, 0.0) / n if n else None

        records.append(
            {
                "workload": workload,
                "transfers_per_run": over_rounds(ms, lambda m: m.counters.get("transfers", 0.0)),
                "failures_per_run": over_rounds(ms, lambda m: m.counters.get("transfer_failures", 0.0)),
                "kib_per_request": over_rounds(ms, lambda m: (per_transfer("transfer_bytes", m) or 0) / 1024),
                "transfer_ms_per_request": 1e3 * over_rounds(ms, lambda m: per_transfer("transfer_seconds", m) or 0),
                "prefill_wait_ms_per_request": 1e3
                * over_rounds(ms, lambda m: per_transfer("prefill_wait_seconds", m) or 0),
                "ttft_mean_s": over_rounds(ms, lambda m: m.ttft_mean),
                "transfer_share_of_ttft": over_rounds(
                    ms, lambda m: (per_transfer("transfer_seconds", m) or 0) / m.ttft_mean
                ),
                "prefill_wait_share_of_ttft": over_rounds(
                    ms, lambda m: (per_transfer("prefill_wait_seconds", m) or 0) / m.ttft_mean
                ),
            }
        )
    headers = ["workload", "transfers / run", "failures / run", "KiB / request", "transfer ms / request"]
    headers += ["prefill wait ms / request", "mean TTFT s", "transfer share of TTFT", "prefill wait share of TTFT"]
    rows = [
        [
            r["workload"],
            fmt(r["transfers_per_run"], 0),
            fmt(r["failures_per_run"], 0),
            fmt(r["kib_per_request"], 1),
            fmt(r["transfer_ms_per_request"], 1),
            fmt(r["prefill_wait_ms_per_request"], 1),
            fmt(r["ttft_mean_s"], 3),
            f"{r['transfer_share_of_ttft']:.1%}",
            f"{r['prefill_wait_share_of_ttft']:.1%}",
        ]
        for r in records
    ]
    return markdown_table(headers, rows), records


def step_table(pd: dict[str, list[Measured]]) -> tuple[str, list[dict]]:
    records = []
    for workload, ms in pd.items():
        for kind in ("idle", "busy"):
            pooled = [step for m in ms for step in getattr(m, f"{kind}_steps")]
            seconds = np.array([s for s, _ in pooled])
            record = {
                "workload": workload,
                "prefill_server": kind,
                "steps": len(pooled),
                "mean_requests": float(np.mean([n for _, n in pooled])) if pooled else None,
            }
            for q in (50, 90, 99):
                record[f"p{q}_ms"] = 1e3 * float(np.percentile(seconds, q)) if pooled else None
            records.append(record)
    headers = ["workload", "prefill server", "decode steps", "mean requests / step", "median ms", "p90 ms", "p99 ms"]
    rows = [
        [
            r["workload"],
            r["prefill_server"],
            str(r["steps"]),
            fmt(r["mean_requests"], 1),
            fmt(r["p50_ms"]),
            fmt(r["p90_ms"]),
            fmt(r["p99_ms"]),
        ]
        for r in records
    ]
    return markdown_table(headers, rows), records


# ---- the experiment -------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, ROWS, rounds=24)  # many streams' (--requests, --concurrency, --max-tokens)
    parser.add_argument("--attacker-chunks", type=int, default=10, help="starvation: the attacker's prompt, chunks")
    parser.add_argument("--victim-tokens", type=int, default=1000, help="starvation: the victim's tokens")
    parser.add_argument("--attacker-after", type=int, default=30, help="victim tokens streamed before the attack")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="of the servers (default: what both workloads need)"
    )
    parser.add_argument("--checksum", action="store_true", help="the decode server with --disaggregation-checksum")
    parser.add_argument("--health-check-interval", type=float, default=1.0, help="the router's, seconds")
    parser.add_argument("--quick", action="store_true", help="1 round, 24 requests at concurrency 8, 5 chunks")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for pd.json and pd.md")
    args = parser.parse_args()
    finish_workload_arguments(parser, args, ROWS)
    if args.quick:
        args.attacker_chunks, args.victim_tokens = 5, 400
    return args


def main() -> None:
    args = parse_args()
    began = time.perf_counter()
    load_at_start, cores = load_average(), cpu_cores()
    server_cpus, client_cpus = split_cpus(args.pin)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)
    vocab = load_config(default_checkpoint_path()).vocab_size
    prompts = [make_prompts(args.requests, i) for i in range(args.rounds)]
    need = max(
        model_len_for([p for ps in prompts for p in ps], args.max_tokens, args.chunk),
        attacker_length(args) + 3,
        8 + args.victim_tokens,
    )
    if args.max_model_len is None:
        args.max_model_len = -(-need // args.chunk) * args.chunk
    elif args.max_model_len < need:
        raise SystemExit(f"pd.py: --max-model-len must hold {need} tokens")
    fronts, processes = start_fronts(args, server_cpus, client_cpus)
    streams_runs: dict[str, list[Measured]] = {name: [] for name in args.rows}
    starvation_runs: dict[str, list[Measured]] = {name: [] for name in args.rows}
    try:
        for front in fronts.values():
            warm_up(front, args, vocab)
        started = time.perf_counter()
        print(f"servers ready after {started - began:.0f} s; {args.rounds} rounds of {args.rows}", flush=True)
        for round_index in range(args.rounds):
            shift = round_index % len(args.rows)
            order = args.rows[shift:] + args.rows[:shift]
            for name in order:
                streams_runs[name].append(streams_run(fronts[name], prompts[round_index], args))
            for name in order:
                starvation_runs[name].append(starvation_run(fronts[name], args, vocab, seed=2 + round_index))
            print(f"round {round_index + 1}/{args.rounds} done at {time.perf_counter() - began:.0f} s", flush=True)
    finally:
        stop_all(processes)
    measured_s = time.perf_counter() - started

    streams_md, streams_records = streams_table(streams_runs)
    starvation_md, starvation_records = starvation_table(starvation_runs)
    parts = [streams_md, "", starvation_md]
    transfers_records: list[dict] = []
    steps_records: list[dict] = []
    if "pd" in args.rows:
        pd = {"many streams": streams_runs["pd"], "starvation": starvation_runs["pd"]}
        transfers_md, transfers_records = transfer_table(pd)
        steps_md, steps_records = step_table(pd)
        parts += ["", "PD transfers (decode server's /metrics, per run):", "", transfers_md]
        parts += ["", "PD decode server's step times, prefill server idle vs busy (pooled over rounds):", "", steps_md]
    load_at_end = load_average()
    cpus = (
        f"servers on CPUs {sorted(server_cpus)}, client and router on {sorted(client_cpus)}"
        if server_cpus
        else "servers, router and client share the CPUs"
    )
    setup = (
        f"{cores} CPU cores ({cpus}); embedded default model, float32, --max-num-seqs {MAX_NUM_SEQS}, "
        f"--chunked-prefill-size {args.chunk}, --max-model-len {args.max_model_len}; many streams: {args.requests} "
        f"requests of 16-300 words at concurrency {args.concurrency}, {args.max_tokens} tokens each; starvation: "
        f"victim {args.victim_tokens} tokens, attacker {args.attacker_chunks} chunks ({attacker_length(args)} "
        f"tokens) after {args.attacker_after}; {args.rounds} rounds; load average {load_at_start} at start, "
        f"{load_at_end} at end; measured {measured_s:.0f} s, whole run {time.perf_counter() - began:.0f} s"
    )
    legend = (
        "Each number is a median over the rounds; `vs colocated`: the median over rounds of (pd / colocated, same "
        "round) - 1. The prefill and decode servers share one core here: the kernel time-slices them, so a prompt "
        "being prefilled slows the decode server's steps instead of taking whole steps from it as a colocated "
        "server's prefill does (the gap columns), while PD's costs (the router hop, a second HTTP exchange, the state "
        "transfer, two engines on one core) show in TTFT and tok/s. On devices of their own neither role would slow "
        "the other. `attacker prefill steps s`: the attacker's prefill steps' seconds summed, from the log of the "
        "server that prefilled it. Transfer figures: counter deltas per run over the run's transfers; shares: over the "
        "mean TTFT of the run's requests. Decode steps: `busy` when the step's span overlaps a prefill step's span on "
        "the prefill server; in many streams a busy step decodes few requests (the others wait for their state), so "
        "the starvation rows, one request either way, compare like with like."
    )
    markdown = "\n".join([setup, "", *parts, "", legend])
    data = {
        "setup": setup,
        "machine": {
            "cpu_cores": cores,
            "jax": version("jax"),
            "load_average_1min_at_start": load_at_start,
            "load_average_1min_at_end": load_at_end,
        },
        "many_streams": streams_records,
        "starvation": starvation_records,
        "transfers": transfers_records,
        "decode_steps": steps_records,
        "runs": [
            {
                "workload": workload,
                "row": name,
                "round": i,
                "ttft_mean_s": m.ttft_mean,
                "gap_p99_s": float(np.percentile(m.run.gaps, 99)),
                "gap_max_s": float(m.run.gaps.max()),
                "counters": m.counters,
                "busy_steps": len(m.busy_steps),
                "idle_steps": len(m.idle_steps),
            }
            for workload, runs in (("many streams", streams_runs), ("starvation", starvation_runs))
            for name, ms in runs.items()
            for i, m in enumerate(ms)
        ],
    }
    common.RESULTS = args.out  # write_results writes under common.RESULTS
    write_results("pd", data, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
