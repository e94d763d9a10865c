"""The starvation experiment end to end: a streaming victim and a long-prompt attacker through the HTTP API.

A victim (short prompt, fixed output, ignore_eos) streams; once it has a few tokens an attacker sends a prompt of
many chunks asking for 3 tokens. Every streamed chunk's arrival time is recorded. Per row: attacker wall time and
TTFT, the attacker's prefill duration and per-chunk time (from the server's own step log), victim wall time and
tokens, the max inter-token gap, the count of big gaps, the predicted stall bound and generated tokens per second.

How it keeps a small, noisy machine honest:
- one real `jaxserve serve` process per flag set, all started up front (rows `alone` and `unset` share the
  flagless one), so a run never waits for a start-up and every row is run many times;
- the servers run on one set of CPUs and this client on another (2 cores: one each), so the client's SSE parsing
  never takes the engine's core;
- rounds: each round runs every row once, in a rotated order, so drift in the machine's speed falls on all rows
  alike. Each number is the median over rounds; the comparisons with `unset` are medians of per-round ratios.

    python benchmarks/interleave.py            # all rows, about 10 minutes on 2 CPU cores
    python benchmarks/interleave.py --quick    # fewer chunks, tokens and rounds
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from common import RESULTS, markdown_table, write_results
from serving import Server, stream

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.config import load_config

PREFILL_LINE = re.compile(r"Prefill batch(?: \(mixed\))?: (\d+) new tokens, (\d+) rows.* ([0-9.]+) s$")
BIG_GAP_FACTOR = 5  # a big gap: above 5x the victim-alone p99 gap; a huge one: above 4x that again
POLICY_ROWS = ("8", "4", "2", "mixed", "stall", "mixed+stall")


@dataclass(frozen=True)
class Row:
    name: str
    flags: tuple[str, ...]
    every: int | None = None  # the interleave count, for the predicted bound
    stall_ms: float | None = None
    attacker: bool = True


@dataclass
class Run:
    """One run of one row: what the client saw and what the server logged meanwhile."""

    row: Row
    victim_stamps: list[float]
    attacker_stamps: list[float]
    start: float
    attacker_start: float | None
    attacker_steps: list[tuple[float, int, float]]  # (log stamp, new tokens, seconds) of the prefill steps after
    # the attack; a step's line is stamped on arrival, within a few ms of the step's end

    @property
    def gaps(self) -> np.ndarray:
        return np.diff(self.victim_stamps)

    @property
    def max_gap(self) -> float:
        return float(self.gaps.max())

    @property
    def pace(self) -> float:
        """The run's decode step as the client sees it (median gap): how fast the machine was during this run."""
        return float(np.median(self.gaps))

    @property
    def t_chunk(self) -> float | None:
        biggest = max((n for _, n, _ in self.attacker_steps), default=0)
        return median([s for _, n, s in self.attacker_steps if n == biggest])

    @property
    def attacker_prefill(self) -> float:
        return sum(s for _, _, s in self.attacker_steps)

    @property
    def max_gap_vs_own_step(self) -> float | None:
        """The worst of the victim's gaps since the attack, each over the step that ended it (the logged prefill
        step whose line came nearest its token). One step per gap gives about 1 whatever the machine's speed at
        that moment; a gap spanning k steps gives about k (a decode-only step ending it is not logged, so its gap
        is paired with the nearest prefill step: for an unmixed row that is the burst's last chunk)."""
        if not self.attacker_steps:
            return None
        stamps = np.array([t for t, _, _ in self.attacker_steps])
        ratios = [
            gap / self.attacker_steps[int(np.abs(stamps - end).argmin())][2]
            for end, gap in zip(self.victim_stamps[1:], self.gaps)
            if end > self.attacker_start
        ]
        return max(ratios)

    @property
    def bound(self) -> float | None:
        if self.row.every is not None:
            return (self.row.every + 1) * self.t_chunk + self.pace
        return self.row.stall_ms / 1000 if self.row.stall_ms is not None else None

    @property
    def victim_wall(self) -> float:
        return self.victim_stamps[-1] - self.start

    @property
    def attacker_ttft(self) -> float | None:
        return self.attacker_stamps[0] - self.attacker_start if self.attacker_stamps else None

    @property
    def gen_tok_s(self) -> float:
        end = max(self.victim_stamps[-1:] + self.attacker_stamps[-1:])
        return (len(self.victim_stamps) + len(self.attacker_stamps)) / (end - self.start)


@dataclass
class Result:
    flag: str
    chunks: int
    t_chunk_s: float
    t_decode_s: float
    attacker_prefill_s: float | None
    attacker_wall_s: float | None
    attacker_ttft_s: float | None
    victim_wall_s: float
    victim_tokens: int
    max_gap_s: float
    big_gaps: int
    huge_gaps: int
    predicted_bound_s: float | None
    gen_tok_s: float
    runs: int
    # Medians over the runs of ratios taken inside one run (both sides saw the same machine speed):
    max_gap_vs_prefill: float | None  # over the attacker's prefill duration
    max_gap_vs_t_chunk: float | None
    max_gap_vs_own_step: float | None  # each gap over the step that ended it, the worst of the run
    max_gap_vs_pure_chunk: float | None  # over the median pure chunk step of unset's run in the same round
    max_gap_vs_bound: float | None
    # Medians over the rounds of (this row / unset's run of the same round) - 1:
    victim_wall_vs_unset: float | None
    gen_tok_s_vs_unset: float | None
    attacker_ttft_vs_unset: float | None
    t_chunk_vs_unset: float | None
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (time since victim start, gap), one run


# ---- the server processes ---------------------------------------------------------------------------------------


def split_cpus(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(server CPUs, client CPUs): the client keeps one core, the servers get the rest."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    return (set(cpus[1:]), set(cpus[:1])) if len(cpus) >= 2 else (None, None)


def server_flags(args: argparse.Namespace, flags: tuple[str, ...]) -> list[str]:
    """The experiment's `jaxserve serve` flags, then a row's."""
    model = ["--model", args.model] if args.model else []
    common = ["--chunked-prefill-size", str(args.chunk), "--max-prefill-rows", "1", "--max-num-seqs", "2"]
    common += ["--max-model-len", str(args.max_model_len), "--dtype", "float32"]
    return [*common, "--decode-log-interval", "100", "--log-stats-interval", "1000", *model, *flags]


def prefill_steps_since(server: Server, since: float) -> list[tuple[float, int, float]]:
    """(stamp, new tokens, seconds) of the prefill steps `server` logged after `since`."""
    return [
        (t, int(m.group(1)), float(m.group(3)))
        for t, line in list(server.lines)
        if t >= since and (m := PREFILL_LINE.search(line))
    ]


def token_prompt(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab, n).tolist()


def attacker_length(args: argparse.Namespace) -> int:
    """The attacker's prompt ends mid-chunk. A mixed step's chunk leaves room for its decode rows (382 of 384 here,
    --max-num-seqs 2), so a prompt ending within a few tokens of a chunk boundary takes one more mixed step than
    unmixed chunks: a boundary effect for a few lengths in 384, not the cost of mixing that the rows compare."""
    return args.attacker_chunks * args.chunk - args.chunk // 2


def run_once(server: Server, args: argparse.Namespace, row: Row, vocab: int, attack_seed: int) -> Run:
    """One victim, attacked by a prompt of `attack_seed`: a new one each round, so no attack is a prefix-cache hit of
    the one before it on the same server."""
    victim_stamps: list[float] = []
    attacker_stamps: list[float] = []
    start = time.perf_counter()
    victim = threading.Thread(
        target=stream, args=(server.url, token_prompt(8, 1, vocab), args.victim_tokens, victim_stamps)
    )
    victim.start()
    attacker_start = None
    if row.attacker:
        while len(victim_stamps) < args.attacker_after and victim.is_alive():
            time.sleep(0.001)  # the attacker arrives while the victim is streaming
        attacker_start = time.perf_counter()
        stream(server.url, token_prompt(attacker_length(args), attack_seed, vocab), 3, attacker_stamps)
    victim.join()
    time.sleep(0.05)  # the last step's log line
    prefill = prefill_steps_since(server, attacker_start) if row.attacker else []
    if len(victim_stamps) != args.victim_tokens or (row.attacker and len(attacker_stamps) != 3):
        raise RuntimeError(f"row {row.name}: victim got {len(victim_stamps)} tokens, attacker {len(attacker_stamps)}")
    return Run(row, victim_stamps, attacker_stamps, start, attacker_start, prefill)


# ---- summarising ------------------------------------------------------------------------------------------------


def median(values):
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(row: Row, runs: list[Run], unset: list[Run] | None, big_gap: float, chunks: int) -> Result:
    """Medians over the rounds; `unset` holds the unset row's runs of the same rounds, for paired ratios."""

    def vs_unset(value) -> float | None:
        """Median over rounds of value(this row's run) / value(unset's run) - 1."""
        return median([value(r) / value(u) - 1 for r, u in zip(runs, unset)]) if unset else None

    def ratio(top, bottom) -> float | None:
        return median([top(r) / bottom(r) for r in runs if bottom(r)])

    middle = sorted(runs, key=lambda r: r.max_gap)[len(runs) // 2]
    attacked = row.attacker
    return Result(
        flag=row.name,
        chunks=chunks if attacked else 0,
        t_chunk_s=median([r.t_chunk for r in runs]) or 0.0,
        t_decode_s=median([r.pace for r in runs]),
        attacker_prefill_s=median([r.attacker_prefill for r in runs]) if attacked else None,
        attacker_wall_s=median([r.attacker_stamps[-1] - r.attacker_start for r in runs]) if attacked else None,
        attacker_ttft_s=median([r.attacker_ttft for r in runs]),
        victim_wall_s=median([r.victim_wall for r in runs]),
        victim_tokens=len(runs[0].victim_stamps),
        max_gap_s=median([r.max_gap for r in runs]),
        big_gaps=round(median([int((r.gaps > big_gap).sum()) for r in runs])),
        huge_gaps=round(median([int((r.gaps > 4 * big_gap).sum()) for r in runs])),
        predicted_bound_s=median([r.bound for r in runs]),
        gen_tok_s=median([r.gen_tok_s for r in runs]),
        runs=len(runs),
        max_gap_vs_prefill=ratio(lambda r: r.max_gap, lambda r: r.attacker_prefill) if attacked else None,
        max_gap_vs_t_chunk=ratio(lambda r: r.max_gap, lambda r: r.t_chunk) if attacked else None,
        max_gap_vs_own_step=median([r.max_gap_vs_own_step for r in runs]) if attacked else None,
        max_gap_vs_pure_chunk=median([r.max_gap / u.t_chunk for r, u in zip(runs, unset) if u.t_chunk])
        if attacked and unset
        else None,
        max_gap_vs_bound=ratio(lambda r: r.max_gap, lambda r: r.bound),
        # The victim's wall is mostly decode steps: counted in its run's own decode steps, the machine's speed
        # drift cancels out. The attacker's TTFT is all prefill, which the decode pace does not measure.
        victim_wall_vs_unset=vs_unset(lambda r: r.victim_wall / r.pace),
        gen_tok_s_vs_unset=vs_unset(lambda r: r.gen_tok_s * r.pace),
        attacker_ttft_vs_unset=vs_unset(lambda r: r.attacker_ttft),
        t_chunk_vs_unset=vs_unset(lambda r: r.t_chunk) if attacked else None,
        gaps=[(float(t - middle.start), float(g)) for t, g in zip(middle.victim_stamps[1:], middle.gaps)],
    )


def checks(results: list[Result], rows: dict[str, Row]) -> list[str]:
    """The issues' acceptance criteria, evaluated on this run."""
    lines = []

    def check(ok: bool, text: str) -> None:
        lines.append(f"- {'ok  ' if ok else 'FAIL'} {text}")

    for r in results:
        row = rows[r.flag]
        if r.flag == "unset":
            check(
                r.max_gap_vs_prefill >= 0.9,
                f"unset: max gap = {r.max_gap_vs_prefill:.2f} x the attacker's prefill duration (>= 0.9)",
            )
            check(
                r.max_gap_vs_own_step >= 2,
                f"unset: worst gap = {r.max_gap_vs_own_step:.1f} x the step that "
                "ended it (>= 2: the burst is one gap of many steps)",
            )
        if row.every is not None:
            check(
                r.max_gap_vs_bound <= 1.25,
                f"{r.flag}: max gap = {r.max_gap_vs_bound:.2f} x the predicted bound (<= 1.25)",
            )
            expected = r.chunks / row.every
            check(
                abs(r.big_gaps - expected) <= 1,
                f"{r.flag}: {r.big_gaps} big gaps, chunks / N = {expected:.2f} (within one)",
            )
            check(
                abs(r.victim_wall_vs_unset) <= 0.05,
                f"{r.flag}: victim wall {r.victim_wall_vs_unset:+.1%} vs unset (within 5%)",
            )
        elif row.stall_ms is not None:
            check(r.max_gap_vs_bound <= 1.2, f"{r.flag}: max gap = {r.max_gap_vs_bound:.2f} x T (<= 1.2)")
        if r.flag == "mixed":
            # A mixed step must cost what a pure chunk does (its chunk leaves room for the decode rows) and no gap
            # may span two steps: the worst gap against the pure chunk step of the unset run of the same round.
            check(
                r.max_gap_vs_pure_chunk <= 1.2,
                f"mixed: max gap = {r.max_gap_vs_pure_chunk:.2f} x the median "
                "pure chunk step (unset's, same round) (<= 1.2)",
            )
            lines.append(f"- info mixed: max gap = {r.max_gap_vs_t_chunk:.2f} x its own median step")
            check(
                abs(r.attacker_ttft_vs_unset) <= 0.10,
                f"mixed: attacker TTFT {r.attacker_ttft_vs_unset:+.1%} vs unset (within 10%)",
            )
        if "mixed" in r.flag:  # the victim advances in every step: no gap spans two (information: the check above)
            lines.append(f"- info {r.flag}: worst gap = {r.max_gap_vs_own_step:.2f} x the step that ended it")
        if r.flag != "unset" and row.attacker:
            # An unmixed row's chunk steps are the same work as unset's: a difference is its server process running
            # faster or slower than unset's (a mixed row's shows what its mixed step costs besides).
            lines.append(f"- info {r.flag}: chunk step {r.t_chunk_vs_unset:+.1%} vs unset's, same round")
        if r.flag not in ("alone", "unset"):
            check(
                abs(r.gen_tok_s_vs_unset) <= 0.05,
                f"{r.flag}: generated tok/s {r.gen_tok_s_vs_unset:+.1%} vs unset (within 5%)",
            )
    return lines


# ---- reporting --------------------------------------------------------------------------------------------------


def fmt(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def pct(value) -> str:
    return "-" if value is None else f"{value:+.1%}"


def table(results: list[Result]) -> str:
    headers = [
        "row",
        "chunks",
        "t_chunk s",
        "attacker prefill s",
        "attacker wall s",
        "attacker TTFT s",
        "victim wall s",
        "paced vs unset",
        "victim tok",
        "max gap s",
        "gaps > 5x p99",
        "gaps > 20x p99",
        "predicted bound s",
        "gen tok/s",
    ]
    return markdown_table(
        headers,
        [
            [
                r.flag,
                str(r.chunks),
                fmt(r.t_chunk_s, 3),
                fmt(r.attacker_prefill_s),
                fmt(r.attacker_wall_s),
                fmt(r.attacker_ttft_s),
                fmt(r.victim_wall_s),
                pct(r.victim_wall_vs_unset),
                str(r.victim_tokens),
                fmt(r.max_gap_s, 3),
                str(r.big_gaps),
                str(r.huge_gaps),
                fmt(r.predicted_bound_s, 3),
                f"{r.gen_tok_s:.1f}",
            ]
            for r in results
        ],
    )


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for r in results:
        t, g = zip(*r.gaps)
        ax.step(t, g, where="pre", label=r.flag, linewidth=1)  # each gap drawn across the time it lasted
    ax.set_yscale("log")
    ax.set_xlabel("time since the victim started (s)")
    ax.set_ylabel("victim inter-token gap (s)")
    ax.set_title("Victim stream gaps while a long prompt prefills (the run with each row's median max gap)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- the experiment ---------------------------------------------------------------------------------------------


def make_row(name: str, stall_ms: int) -> Row:
    if name in ("alone", "unset"):  # prefill-first: the baseline every policy is compared with
        return Row(name, ("--no-mixed-batches",), attacker=name == "unset")
    if name.isdigit():
        return Row(name, ("--decode-interleave-every", name), every=int(name))
    if name not in POLICY_ROWS:
        raise SystemExit(
            f"interleave.py: unknown row {name!r}; rows are alone, unset, {', '.join(POLICY_ROWS)} "
            "or any interleave count"
        )
    flags = (("--mixed-batches",) if "mixed" in name else ()) + (
        ("--max-decode-stall-ms", str(stall_ms)) if "stall" in name else ()
    )
    label = name.replace("stall", f"stall-{stall_ms / 1000:g}s")
    return Row(label, flags, stall_ms=stall_ms if "stall" in name else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default)")
    parser.add_argument("--chunk", type=int, default=384, help="--chunked-prefill-size of the servers")
    parser.add_argument("--attacker-chunks", type=int, default=10)
    parser.add_argument("--victim-tokens", type=int, default=1000)
    parser.add_argument("--attacker-after", type=int, default=30, help="victim tokens streamed before the attack")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--rows", default="alone,unset,8,4,2,mixed,stall,mixed+stall")
    parser.add_argument("--rounds", type=int, default=21, help="runs per row; the table shows medians")
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let servers and client share every CPU instead of splitting them",
    )
    parser.add_argument("--quick", action="store_true", help="5 chunks, 400 victim tokens, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.attacker_chunks, args.victim_tokens, args.rounds = 5, 400, 2
    if attacker_length(args) + 3 > args.max_model_len:
        raise SystemExit("interleave.py: --max-model-len must hold the attacker's prompt and output")

    began = time.perf_counter()
    server_cpus, client_cpus = split_cpus(args.pin)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)
    vocab = load_config(args.model or default_checkpoint_path()).vocab_size
    servers: dict[tuple[str, ...], Server] = {}

    def server_for(row: Row) -> Server:
        if row.flags not in servers:
            print(f"starting jaxserve serve {' '.join(row.flags) or '(no flags)'}", flush=True)
            servers[row.flags] = Server(server_flags(args, row.flags), server_cpus)
            stream(servers[row.flags].url, token_prompt(8, 1, vocab), 16, [])  # the HTTP path's first call
        return servers[row.flags]

    try:
        # T for the stall rows: 3x the chunk time the flagless server measures, attacked alone three times.
        flagless = server_for(make_row("unset", 0))
        chunk_times = []
        for seed in range(3):
            since = time.perf_counter()
            stream(flagless.url, token_prompt(attacker_length(args), 1000 + seed, vocab), 3, [])
            time.sleep(0.05)
            chunk_times += [s for _, n, s in prefill_steps_since(flagless, since) if n == args.chunk]
        t_chunk = statistics.median(chunk_times)
        rows = [make_row(name, round(3 * 1000 * t_chunk)) for name in args.rows.split(",")]
        for row in rows:
            server_for(row)
        print(
            f"servers ready after {time.perf_counter() - began:.0f} s; t_chunk {t_chunk:.3f} s; "
            f"{args.rounds} rounds of {len(rows)} rows",
            flush=True,
        )
        runs: dict[str, list[Run]] = {row.name: [] for row in rows}
        for round_index in range(args.rounds):
            shift = round_index % len(rows)
            for row in rows[shift:] + rows[:shift]:
                runs[row.name].append(run_once(servers[row.flags], args, row, vocab, attack_seed=2 + round_index))
            print(f"round {round_index + 1}/{args.rounds} done at {time.perf_counter() - began:.0f} s", flush=True)
    finally:
        for server in servers.values():
            server.stop()

    alone = runs.get("alone") or runs.get(rows[0].name)
    big_gap = BIG_GAP_FACTOR * statistics.median(float(np.percentile(r.gaps, 99)) for r in alone)
    unset = runs.get("unset")
    results = [
        summarise(row, runs[row.name], unset if row.attacker else None, big_gap, args.attacker_chunks) for row in rows
    ]
    verdicts = checks(results, {row.name: row for row in rows})
    cpus = (
        f"servers on CPUs {sorted(server_cpus)}, client on {sorted(client_cpus)}"
        if server_cpus
        else "servers and client share the CPUs"
    )
    setup = (
        f"{os.cpu_count()} CPU cores ({cpus}); {args.model or 'embedded default model'}, float32, "
        f"--chunked-prefill-size {args.chunk}, --max-model-len {args.max_model_len}; victim "
        f"{args.victim_tokens} tokens, attacker {args.attacker_chunks} chunks after {args.attacker_after} "
        f"victim tokens; {args.rounds} rounds; big gap > {big_gap * 1000:.1f} ms; whole run "
        f"{time.perf_counter() - began:.0f} s"
    )
    records = [{k: v for k, v in asdict(r).items() if k != "gaps"} for r in results]
    per_run = [
        {
            "row": name,
            "round": i,
            "victim_wall_s": r.victim_wall,
            "pace_s": r.pace,
            "max_gap_s": r.max_gap,
            "t_chunk_s": r.t_chunk,
            "attacker_prefill_s": r.attacker_prefill,
            "attacker_ttft_s": r.attacker_ttft,
            "predicted_bound_s": r.bound,
            "gen_tok_s": r.gen_tok_s,
            "max_gap_vs_own_step": r.max_gap_vs_own_step if r.row.attacker else None,
        }
        for name, rs in runs.items()
        for i, r in enumerate(rs)
    ]
    legend = (
        "Each number is the median over the rounds. `paced vs unset`: the median over rounds of (victim wall / "
        "unset's victim wall in the same round) - 1, each wall counted in its own run's decode steps (median "
        "victim gap), which cancels the machine's speed drift; the checks below pair runs by round the same "
        "way (the attacker's TTFT, all prefill, is compared in seconds). `worst gap x the step that ended it`: each "
        "victim gap since the attack over the logged step whose line came nearest its token, the worst of a run "
        "(median over rounds): one step per gap whatever the machine's speed at that moment gives about 1. "
        "`chunk step vs unset's`: each server is its own process, and a process can run at its own speed (in two "
        "21-round runs one server, of a different row each time, ran its chunk steps about 30% faster from its "
        "fourth round on); this shows it, and the comparisons of that row with unset move with it."
    )
    markdown = "\n".join([setup, "", table(results), "", legend, "", *verdicts])
    write_results("interleave", records, markdown)
    (RESULTS / "interleave_runs.json").write_text(json.dumps(per_run, indent=1) + "\n")
    (RESULTS / "interleave_gaps.json").write_text(json.dumps({r.flag: r.gaps for r in results}) + "\n")
    plot(results, RESULTS / "interleave.png")
    print(markdown)


if __name__ == "__main__":
    main()
