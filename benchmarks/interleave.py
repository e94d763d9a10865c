"""The starvation experiment end to end: a streaming victim and a long-prompt attacker through the HTTP API.

Each row starts `jaxserve serve` as a real process on 127.0.0.1 with one scheduling policy, streams a victim
(short prompt, fixed output, ignore_eos), fires an attacker (a prompt of many chunks, 3 output tokens) once the
victim is streaming, and records every streamed chunk's arrival time. Per row: attacker wall time and TTFT, victim
wall time and tokens, the max inter-token gap, the count of big gaps, the measured per-chunk prefill time
(from the server's own step log) and the predicted stall bound (N+1) x t_chunk + t_decode.

    python benchmarks/interleave.py            # all rows, ~10 minutes on 2 CPU cores
    python benchmarks/interleave.py --quick    # fewer chunks and tokens
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from checkpoints import default_checkpoint_path
from jaxserve.config import load_config

RESULTS = Path(__file__).parent / "results"
PREFILL_LINE = re.compile(r"Prefill batch(?: \(mixed\))?: (\d+) new tokens, (\d+) rows.* ([0-9.]+) s$")
DECODE_LINE = re.compile(r"Decode batch.*: (\d+) requests.* ([0-9.]+) s$")


@dataclass
class Row:
    name: str
    flags: list[str]
    every: int | None = None  # the interleave count, for the predicted bound
    stall_ms: float | None = None


@dataclass
class Result:
    flag: str
    chunks: int
    t_chunk_s: float
    t_decode_s: float
    attacker_wall_s: float | None
    attacker_ttft_s: float | None
    victim_wall_s: float
    victim_tokens: int
    max_gap_s: float
    big_gaps: int
    huge_gaps: int
    predicted_bound_s: float | None
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (time since victim start, gap)


# ---- the server process -----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`jaxserve serve` in a subprocess; its log lines are kept for the step timings."""

    def __init__(self, args: argparse.Namespace, flags: list[str]):
        self.port = free_port()
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--chunked-prefill-size", str(args.chunk), "--max-prefill-rows", "1", "--max-num-seqs", "2",
               "--max-model-len", str(args.max_model_len), "--dtype", "float32", "--decode-log-interval", "1",
               "--log-stats-interval", "1000", *(["--model", args.model] if args.model else []), *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[tuple[float, str]] = []
        ready = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.lines.append((time.perf_counter(), line.rstrip()))
                if "jaxserve ready on" in line:
                    ready.set()
        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout=600) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("server did not become ready:\n" + "\n".join(l for _, l in self.lines[-30:]))
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def step_times(self, since: float) -> tuple[list[float], list[float]]:
        """Durations of full-size prefill steps and of decode steps logged after `since`."""
        prefill, decode = [], []
        for t, line in self.lines:
            if t < since:
                continue
            if m := PREFILL_LINE.search(line):
                prefill.append((int(m.group(1)), float(m.group(3))))
            elif m := DECODE_LINE.search(line):
                decode.append(float(m.group(2)))
        biggest = max((n for n, _ in prefill), default=0)
        return [s for n, s in prefill if n == biggest], decode


# ---- the client side --------------------------------------------------------------------------------------------

def stream(url: str, prompt: list[int], max_tokens: int, stamps: list[float], done: threading.Event) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=None) as client, client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                stamps.append(time.perf_counter())
    done.set()


def token_prompt(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab, n).tolist()


def run_row(args: argparse.Namespace, row: Row, alone_p99: float | None) -> Result:
    server = Server(args, row.flags)
    try:
        vocab = load_config(args.model or default_checkpoint_path()).vocab_size
        victim_stamps: list[float] = []
        attacker_stamps: list[float] = []
        victim_done, attacker_done = threading.Event(), threading.Event()
        start = time.perf_counter()
        threading.Thread(target=stream, args=(server.url, token_prompt(8, 1, vocab), args.victim_tokens,
                                              victim_stamps, victim_done), daemon=True).start()
        attacker_start = None
        if row.name != "alone":
            while len(victim_stamps) < args.attacker_after and not victim_done.is_set():
                time.sleep(0.001)  # the attacker arrives while the victim is streaming
            attacker_start = time.perf_counter()
            prompt = token_prompt(args.attacker_chunks * args.chunk - 8, 2, vocab)
            threading.Thread(target=stream, args=(server.url, prompt, 3, attacker_stamps, attacker_done),
                             daemon=True).start()
            attacker_done.wait(timeout=600)
        victim_done.wait(timeout=600)
        prefill_times, decode_times = server.step_times(start)
    finally:
        server.stop()
    gaps = np.diff(victim_stamps)
    t_chunk = statistics.median(prefill_times) if prefill_times and attacker_start else 0.0
    t_decode = statistics.median(decode_times) if decode_times else float(np.median(gaps))
    threshold = 5 * (alone_p99 if alone_p99 is not None else float(np.percentile(gaps, 99)))
    bound = None
    if row.every is not None:
        bound = (row.every + 1) * t_chunk + t_decode
    elif row.stall_ms is not None:
        bound = row.stall_ms / 1000
    return Result(
        flag=row.name, chunks=args.attacker_chunks if attacker_start else 0, t_chunk_s=t_chunk, t_decode_s=t_decode,
        attacker_wall_s=(attacker_stamps[-1] - attacker_start) if attacker_stamps else None,
        attacker_ttft_s=(attacker_stamps[0] - attacker_start) if attacker_stamps else None,
        victim_wall_s=victim_stamps[-1] - start, victim_tokens=len(victim_stamps), max_gap_s=float(gaps.max()),
        big_gaps=int((gaps > threshold).sum()), huge_gaps=int((gaps > 4 * threshold).sum()),
        predicted_bound_s=bound,
        gaps=[(float(t - start), float(g)) for t, g in zip(victim_stamps[1:], gaps)],
    )


def median_result(runs: list[Result]) -> Result:
    """Each number the median over the repeats; the gap trace of the run with the median max gap."""
    def med(values):
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    middle = sorted(runs, key=lambda r: r.max_gap_s)[len(runs) // 2]
    numbers = {name: med([getattr(r, name) for r in runs]) for name in asdict(middle)
               if name not in ("flag", "chunks", "gaps")}
    for name in ("victim_tokens", "big_gaps", "huge_gaps"):
        numbers[name] = int(round(numbers[name]))
    return Result(flag=middle.flag, chunks=middle.chunks, gaps=middle.gaps, **numbers)


# ---- reporting --------------------------------------------------------------------------------------------------

def fmt(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: list[Result]) -> str:
    head = ("| row | chunks | t_chunk s | attacker wall s | attacker TTFT s | victim wall s | victim tok | "
            "max gap s | gaps > 5x p99 | gaps > 20x p99 | predicted bound s | gen tok/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        generated = r.victim_tokens + (3 if r.attacker_wall_s is not None else 0)
        span = max(r.victim_wall_s, r.attacker_wall_s or 0)
        lines.append(f"| {r.flag} | {r.chunks} | {fmt(r.t_chunk_s, 3)} | {fmt(r.attacker_wall_s)} | "
                     f"{fmt(r.attacker_ttft_s)} | {fmt(r.victim_wall_s)} | {r.victim_tokens} | {fmt(r.max_gap_s)} | "
                     f"{r.big_gaps} | {r.huge_gaps} | {fmt(r.predicted_bound_s)} | {generated / span:.1f} |")
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 5))
    for r in results:
        if r.gaps:
            t, g = zip(*r.gaps)
            ax.plot(t, g, label=r.flag, linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("time since the victim started (s)")
    ax.set_ylabel("victim inter-token gap (s)")
    ax.set_title("Victim stream gaps while a long prompt prefills")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default)")
    parser.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size of the server")
    parser.add_argument("--attacker-chunks", type=int, default=7)
    parser.add_argument("--victim-tokens", type=int, default=1500)
    parser.add_argument("--attacker-after", type=int, default=30, help="victim tokens streamed before the attack")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--rows", default="alone,unset,8,4,2,mixed,stall,mixed+stall")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the table shows medians")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.attacker_chunks, args.victim_tokens, args.repeats = 5, 600, 1

    results: list[Result] = []
    alone_p99 = None
    stall_ms = None
    for name in args.rows.split(","):
        if name == "alone":
            row = Row("alone", [])
        elif name == "unset":
            row = Row("unset", [])
        elif name.isdigit():
            row = Row(name, ["--decode-interleave-every", name], every=int(name))
        else:
            if stall_ms is None:
                unset = next((r for r in results if r.flag == "unset"), None)
                stall_ms = round(3 * 1000 * (unset.t_chunk_s if unset else 1.0))
            flags = (["--mixed-batches"] if "mixed" in name else []) + (
                ["--max-decode-stall-ms", str(stall_ms)] if "stall" in name else [])
            label = name.replace("stall", f"stall-{stall_ms / 1000:g}s")
            row = Row(label, flags, stall_ms=stall_ms if "stall" in name else None)
        print(f"== row {row.name}: {' '.join(row.flags) or '(no flags)'}", flush=True)
        result = median_result([run_row(args, row, alone_p99) for _ in range(args.repeats)])
        if row.name == "alone":
            alone_p99 = float(np.percentile([g for _, g in result.gaps], 99))
        results.append(result)
        print(table([result]).splitlines()[-1], flush=True)

    RESULTS.mkdir(exist_ok=True)
    rows = [{k: v for k, v in asdict(r).items() if k != "gaps"} for r in results]
    (RESULTS / "interleave.json").write_text(json.dumps(rows, indent=2) + "\n")
    (RESULTS / "interleave_gaps.json").write_text(json.dumps({r.flag: r.gaps for r in results}) + "\n")
    markdown = table(results)
    (RESULTS / "interleave.md").write_text(markdown + "\n")
    plot(results, RESULTS / "interleave.png")
    print(markdown)


if __name__ == "__main__":
    main()
