"""The "many streams" workload end to end: many streamed completions at once through the HTTP API, per scheduling
policy.

A client sends 64 streamed `/v1/completions` requests (`ignore_eos`, a fixed `max_tokens`, greedy), keeping 16 in
flight: it starts the next request when one ends. The prompts are 16 to 300 random words of a small English
vocabulary, drawn with a fixed seed per round: every row of a round gets the same ones, and each round new ones (a
prompt a server has seen would be a prefix-cache hit). Every streamed chunk's arrival time is recorded. Each row is
one `jaxserve serve --max-num-seqs 16 --dtype float32` process on the embedded default checkpoint, with the row's
scheduling flags (the ROWS table below).

Per row, medians over the rounds of:
- the inter-token gaps (consecutive chunks of one request, after its first token) of all requests: median, p99, max;
- time to first token (from sending the request): median and p99;
- generated tokens per second: all generated tokens over the wall time of the run;
- the pure-chunk step: the median duration of the prefill steps that fill a whole chunk and carry no decode rows,
  from the server's own step log. It is what a prefill step costs a running request when it does not advance it;
- p99 gap / pure-chunk step, the step taken from the `prefill-first` row of the same round (the row with the most
  such steps; the row's own when `prefill-first` is not run), and generated tok/s vs `prefill-first` (per-round
  ratios).

As in interleave.py: all servers start up front and compile every step shape before anything is measured; servers
and client run on different CPUs; each round runs every row once, in a rotated order, so the machine's drift falls
on all rows alike.

    python benchmarks/streams.py            # 3 rounds of 64 requests at concurrency 16
    python benchmarks/streams.py --quick    # 1 round of 24 requests at concurrency 8
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import common
import numpy as np
from common import RESULTS, markdown_table, write_results
from interleave import PREFILL_LINE, Server, fmt, median, pct, server_flags, split_cpus, stream

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.config import EngineConfig
from jaxserve.text.tokenizer import load_tokenizer

# Each row's scheduling flags; everything else about the servers is the same.
ROWS = {
    "default": (),
    "prefill-first": ("--no-mixed-batches",),
    "interleave 8": ("--decode-interleave-every", "8"),
}
BASELINE = "prefill-first"  # the row the others' throughput and its pure-chunk steps are compared with
CHECKED = "default"  # the row the acceptance checks are about
MAX_NUM_SEQS = 16
MIN_WORDS, MAX_WORDS = 16, 300
PROMPT_SEED = 0
WORDS = (
    "the of and to in is it that for on with as was at by from this have not are but all can one time year "
    "people way day man thing woman life child world school state family student group country problem hand "
    "part place case week company system program question work government number night point home water "
    "room mother area money story fact month lot right study book eye job word business issue side kind "
    "head house service friend father power hour game line end member law car city community name"
).split()


@dataclass
class Run:
    """One run of the workload on one row's server: what the client saw and the server's steps meanwhile."""

    sent: list[float]  # per request, when it was sent
    stamps: list[list[float]]  # per request, each streamed chunk's arrival
    chunk_steps: list[float]  # seconds of each pure-chunk step the server logged during the run

    @property
    def gaps(self) -> np.ndarray:
        return np.concatenate([np.diff(s) for s in self.stamps])

    @property
    def ttfts(self) -> np.ndarray:
        return np.array([s[0] - t for t, s in zip(self.sent, self.stamps)])

    @property
    def gen_tok_s(self) -> float:
        wall = max(s[-1] for s in self.stamps) - min(self.sent)
        return sum(len(s) for s in self.stamps) / wall

    @property
    def chunk_step(self) -> float | None:
        return median(self.chunk_steps)


@dataclass
class Result:
    row: str
    gap_median_ms: float
    gap_p99_ms: float
    gap_max_ms: float
    ttft_median_s: float
    ttft_p99_s: float
    gen_tok_s: float
    gen_tok_s_vs_baseline: float | None  # median over rounds of (this row / prefill-first, same round) - 1
    chunk_step_ms: float | None  # this row's own median pure-chunk step
    chunk_steps: int  # pure-chunk steps per run (median)
    p99_gap_vs_chunk_step: float | None  # over prefill-first's pure-chunk step of the same round
    runs: int


# ---- the servers and the client ---------------------------------------------------------------------------------


def workload_flags(chunk: int, max_model_len: int, flags: tuple[str, ...] = ()) -> list[str]:
    """This workload's `jaxserve serve` flags, then a row's. interleave's are set up for its two-request experiment (2
    slots, 1 prefill row); a flag given again later wins (argparse keeps the last value), so these give this workload
    its slots and restore the engine's default prefill rows: apart from the row's flags, every server runs the
    engine's defaults."""
    workload = ("--max-num-seqs", str(MAX_NUM_SEQS), "--max-prefill-rows", str(EngineConfig.max_prefill_rows))
    return server_flags(argparse.Namespace(chunk=chunk, max_model_len=max_model_len, model=None), workload + flags)


def start_server(flags: tuple[str, ...], chunk: int, max_model_len: int, cpus: set[int] | None) -> Server:
    server = Server(workload_flags(chunk, max_model_len, flags), cpus)
    stream(server.url, "warm up", 4, [])  # the HTTP path's first call, outside the measurement
    return server


def pure_chunk_steps(server: Server, since: float, chunk: int) -> list[float]:
    """Seconds of the steps logged after `since` that prefilled a whole chunk with no decode rows in them."""
    return [
        float(m.group(3))
        for t, line in list(server.lines)
        if t >= since and "(mixed)" not in line and (m := PREFILL_LINE.search(line)) and int(m.group(1)) == chunk
    ]


def make_prompts(count: int, round_index: int) -> list[str]:
    rng = np.random.default_rng(PROMPT_SEED + round_index)
    return [" ".join(rng.choice(WORDS, n)) for n in rng.integers(MIN_WORDS, MAX_WORDS + 1, count)]


def model_len_for(prompts: list[str], max_tokens: int, chunk: int) -> int:
    """--max-model-len holding the longest prompt and its completion, in whole chunks (300 words are about 1000
    tokens of the default tokenizer's small vocabulary)."""
    tokenizer = load_tokenizer(default_checkpoint_path())
    need = max(len(tokenizer.encode(p)) for p in prompts) + max_tokens
    return -(-need // chunk) * chunk


def run_workload(server: Server, prompts: list[str], args: argparse.Namespace) -> Run:
    sent = [0.0] * len(prompts)
    stamps: list[list[float]] = [[] for _ in prompts]

    def send(i: int) -> None:
        sent[i] = time.perf_counter()
        stream(server.url, prompts[i], args.max_tokens, stamps[i])

    since = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:  # a free worker takes the next request: `concurrency` in flight
        list(pool.map(send, range(len(prompts))))  # list(): a failed request raises here
    time.sleep(0.05)  # the last step's log line
    short = [len(s) for s in stamps if len(s) != args.max_tokens]
    if short:
        raise RuntimeError(f"{len(short)} requests streamed {short} chunks, not {args.max_tokens}")
    return Run(sent, stamps, pure_chunk_steps(server, since, args.chunk))


# ---- summarising ------------------------------------------------------------------------------------------------


def summarise(row: str, runs: list[Run], baseline: list[Run] | None) -> Result:
    """Medians over the rounds; `baseline` holds prefill-first's runs of the same rounds, for paired ratios."""

    def over_rounds(value) -> float | None:
        return median([value(r) for r in runs])

    paired = list(zip(runs, baseline or runs))
    chunk_step = [b.chunk_step or r.chunk_step for r, b in paired]  # the row's own where prefill-first has none
    own_chunk_step = over_rounds(lambda r: r.chunk_step)
    return Result(
        row=row,
        gap_median_ms=1e3 * over_rounds(lambda r: float(np.median(r.gaps))),
        gap_p99_ms=1e3 * over_rounds(lambda r: float(np.percentile(r.gaps, 99))),
        gap_max_ms=1e3 * over_rounds(lambda r: float(r.gaps.max())),
        ttft_median_s=over_rounds(lambda r: float(np.median(r.ttfts))),
        ttft_p99_s=over_rounds(lambda r: float(np.percentile(r.ttfts, 99))),
        gen_tok_s=over_rounds(lambda r: r.gen_tok_s),
        gen_tok_s_vs_baseline=median([r.gen_tok_s / b.gen_tok_s - 1 for r, b in paired]) if baseline else None,
        chunk_step_ms=None if own_chunk_step is None else 1e3 * own_chunk_step,
        chunk_steps=round(over_rounds(lambda r: len(r.chunk_steps))),
        p99_gap_vs_chunk_step=median(
            [float(np.percentile(r.gaps, 99)) / step for (r, _), step in zip(paired, chunk_step) if step]
        ),
        runs=len(runs),
    )


def checks(results: dict[str, Result]) -> list[str]:
    """The issue's acceptance criteria, evaluated on this run: findings, not errors."""
    checked = results.get(CHECKED)
    if checked is None:
        return [f"SKIP {CHECKED}: row not run"]

    def verdict(value: float | None, ok, claim: str, figures: str, missing: str) -> str:
        if value is None:
            return f"SKIP {CHECKED}: {claim} ({missing})"
        return f"{'PASS' if ok(value) else 'FAIL'} {CHECKED}: {claim} ({figures})"

    ratio, versus = checked.p99_gap_vs_chunk_step, checked.gen_tok_s_vs_baseline
    return [
        verdict(
            ratio,
            lambda v: v <= 1.5,
            "p99 gap <= 1.5 x median pure-chunk step",
            f"p99 gap {checked.gap_p99_ms:.1f} ms = {ratio or 0:.2f} x",
            "no pure-chunk step logged",
        ),
        verdict(
            versus,
            lambda v: abs(v) <= 0.05,
            f"generated tok/s within 5% of {BASELINE}",
            f"{checked.gen_tok_s:.1f} tok/s, {versus or 0:+.1%}",
            f"{BASELINE} not run",
        ),
    ]


def table(results: list[Result]) -> str:
    headers = [
        "row",
        "gap median ms",
        "gap p99 ms",
        "gap max ms",
        "TTFT median s",
        "TTFT p99 s",
        "gen tok/s",
        f"tok/s vs {BASELINE}",
        "pure-chunk step ms",
        "pure-chunk steps",
        "p99 gap / chunk step",
    ]
    return markdown_table(
        headers,
        [
            [
                r.row,
                fmt(r.gap_median_ms, 1),
                fmt(r.gap_p99_ms, 1),
                fmt(r.gap_max_ms, 1),
                fmt(r.ttft_median_s),
                fmt(r.ttft_p99_s),
                fmt(r.gen_tok_s, 1),
                pct(r.gen_tok_s_vs_baseline),
                fmt(r.chunk_step_ms, 1),
                str(r.chunk_steps),
                fmt(r.p99_gap_vs_chunk_step),
            ]
            for r in results
        ],
    )


# ---- the experiment ---------------------------------------------------------------------------------------------


def add_workload_arguments(parser: argparse.ArgumentParser, rows, rounds: int) -> None:
    """This workload's flags (and the rows and rounds of a benchmark that runs it), for its own parser and pd.py's."""
    parser.add_argument("--rows", default=",".join(rows), help="comma-separated, of: " + ", ".join(rows))
    parser.add_argument("--rounds", type=int, default=rounds, help="runs per row; the tables show medians")
    parser.add_argument("--requests", type=int, default=64, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=16, help="requests the client keeps in flight")
    parser.add_argument("--max-tokens", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--chunk", type=int, default=256, help="--chunked-prefill-size of the servers")
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let servers and client share every CPU instead of splitting them",
    )


def finish_workload_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, rows) -> None:
    """--quick's run (1 round of 24 requests at concurrency 8) and --rows as a checked list."""
    if args.quick:
        args.rounds, args.requests, args.concurrency = 1, 24, 8
    args.rows = args.rows.split(",")
    unknown = [name for name in args.rows if name not in rows]
    if unknown:
        parser.error(f"unknown rows {unknown}; rows are {', '.join(rows)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, ROWS, rounds=3)
    parser.add_argument("--quick", action="store_true", help="1 round of 24 requests at concurrency 8")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for streams.json and streams.md")
    args = parser.parse_args()
    finish_workload_arguments(parser, args, ROWS)
    return args


def main() -> None:
    args = parse_args()
    began = time.perf_counter()
    server_cpus, client_cpus = split_cpus(args.pin)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)
    prompts = [make_prompts(args.requests, i) for i in range(args.rounds)]
    max_model_len = model_len_for([p for round_prompts in prompts for p in round_prompts], args.max_tokens, args.chunk)
    servers: dict[str, Server] = {}
    try:
        for name in args.rows:
            print(f"starting jaxserve serve for {name}: {' '.join(ROWS[name]) or '(no flags)'}", flush=True)
            servers[name] = start_server(ROWS[name], args.chunk, max_model_len, server_cpus)
        print(
            f"servers ready after {time.perf_counter() - began:.0f} s; {args.rounds} rounds of {len(args.rows)} rows",
            flush=True,
        )
        runs: dict[str, list[Run]] = {name: [] for name in args.rows}
        for round_index in range(args.rounds):
            shift = round_index % len(args.rows)
            for name in args.rows[shift:] + args.rows[:shift]:
                runs[name].append(run_workload(servers[name], prompts[round_index], args))
            print(f"round {round_index + 1}/{args.rounds} done at {time.perf_counter() - began:.0f} s", flush=True)
    finally:
        for server in servers.values():
            server.stop()

    results = {name: summarise(name, runs[name], runs.get(BASELINE)) for name in args.rows}
    verdicts = checks(results)
    cpus = (
        f"servers on CPUs {sorted(server_cpus)}, client on {sorted(client_cpus)}"
        if server_cpus
        else "servers and client share the CPUs"
    )
    setup = (
        f"{os.cpu_count()} CPU cores ({cpus}); embedded default model, float32, --max-num-seqs {MAX_NUM_SEQS}, "
        f"--chunked-prefill-size {args.chunk}, --max-model-len {max_model_len}; {args.requests} requests of "
        f"{MIN_WORDS}-{MAX_WORDS} words at concurrency {args.concurrency}, {args.max_tokens} tokens each; "
        f"{args.rounds} rounds; whole run {time.perf_counter() - began:.0f} s"
    )
    legend = (
        f"Each number is the median over the rounds. Gaps: between consecutive chunks of one request, all "
        f"requests together. Pure-chunk step: a prefill step of a whole chunk with no decode rows, from the "
        f"server's log. `p99 gap / chunk step` divides by {BASELINE}'s pure-chunk step of the same round (the "
        f"row's own when {BASELINE} is not run); `tok/s vs {BASELINE}`: per-round ratios, minus 1."
    )
    markdown = "\n".join([setup, "", table(list(results.values())), "", legend, "", *verdicts])
    per_run = [
        {
            "row": name,
            "round": i,
            "gap_p99_s": float(np.percentile(r.gaps, 99)),
            "gap_max_s": float(r.gaps.max()),
            "ttft_median_s": float(np.median(r.ttfts)),
            "gen_tok_s": r.gen_tok_s,
            "chunk_step_s": r.chunk_step,
            "chunk_steps": len(r.chunk_steps),
        }
        for name, rs in runs.items()
        for i, r in enumerate(rs)
    ]
    common.RESULTS = args.out  # write_results writes under common.RESULTS
    write_results(
        "streams",
        {"setup": setup, "rows": [asdict(r) for r in results.values()], "runs": per_run, "checks": verdicts},
        markdown,
    )
    print(markdown)


if __name__ == "__main__":
    main()
