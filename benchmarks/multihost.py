"""Multi-controller serving on one machine: what sending each step's plan to the other processes costs.

Two servers of the embedded default (float32, TP 2 x EP 4, --max-num-seqs 8) run side by side: one process of 8 CPU
devices, and a group of 2 processes of 4 devices each (gloo collectives between them). Each round sends both the
same batch of 8 streamed requests, one server after the other (rotated), and takes the median inter-token gap of
the streams: the decode step's period at batch 8. At the end process 0 of the group is stopped cleanly and reports
the time it spent sending its step messages (one per step), which is set against that period.

A second table compares the two ways a message could travel between the processes, measured in two bare processes
with the same message size: the coordination service's key-value store (what jaxserve uses: process 0 sets a key,
each other process waits for it) and a broadcast collective over the devices (jax's multihost broadcast).

    python benchmarks/multihost.py             # 5 rounds of 8 x 96 tokens, about 4 minutes on 2 CPU cores
    python benchmarks/multihost.py --quick
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

import httpx
from common import REPO, load_average, markdown_table, write_results

FLAGS = ["--dtype", "float32", "--tensor-parallel-size", "2", "--expert-parallel-size", "4", "--max-num-seqs", "8"]
FLAGS += ["--no-mixed-batches", "--chunked-prefill-size", "64", "--max-prefill-rows", "1", "--max-model-len", "512"]
SENT_LINE = re.compile(
    r"sent (\d+) step messages .*?, (\d+) B each on average; send time median (\d+) us, max (\d+) us"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """`jaxserve serve` with `devices` CPU devices; its output kept."""

    def __init__(self, devices: int, *flags: str):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *FLAGS, "--log-stats-interval", "1000", *flags]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("compiled all "):
                self.ready.set()
        self.ready.set()

    def wait_ready(self) -> None:
        self.ready.wait(timeout=1200)
        if self.proc.poll() is not None:
            raise RuntimeError("server exited:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: drain and stop cleanly
        return self.proc.wait(timeout=120)


def decode_period(url: str, tokens: int) -> float:
    """Median inter-token gap (s) of 8 concurrent streams of `tokens` tokens each."""
    gaps: list[float] = []
    lock = threading.Lock()

    def stream(i: int) -> None:
        body = {"prompt": [10 + i, 11, 12], "max_tokens": tokens, "ignore_eos": True, "stream": True, "temperature": 0}
        arrivals = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())
        with lock:  # the first gaps wait for the other streams' prefills
            gaps.extend(b - a for a, b in zip(arrivals[16:], arrivals[17:]))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statistics.median(gaps)


CHANNEL_WORKER = """
import os, sys, time, statistics, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
rank, port, size, repeats = map(int, sys.argv[1:5])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
from jax._src.distributed import global_state
from jax.experimental import multihost_utils
client = global_state.client
payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
kv, collective = [], []
for i in range(repeats):
    multihost_utils.sync_global_devices(f"round {i}")
    t = time.perf_counter()
    if rank == 0:
        client.key_value_set_bytes(f"m/{i}", payload.tobytes())
    else:
        client.blocking_key_value_get_bytes(f"m/{i}", 10000)
    kv.append(time.perf_counter() - t)
    t = time.perf_counter()
    np.asarray(multihost_utils.broadcast_one_to_all(payload))
    collective.append(time.perf_counter() - t)
if rank == 0:
    medians = {"kv_us": statistics.median(kv[5:]), "collective_us": statistics.median(collective[5:])}
    print(json.dumps({name: seconds * 1e6 for name, seconds in medians.items()}))
"""


def channel_costs(size: int, repeats: int) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-c", CHANNEL_WORKER]
    args = [str(port), str(size), str(repeats)]
    other = subprocess.Popen([*cmd, "1", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = subprocess.run([*cmd, "0", *args], capture_output=True, text=True, timeout=300)
    other.wait(timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tokens = 2, 48
    load_start = load_average()
    single_port, group_port, coordinator = free_port(), free_port(), f"127.0.0.1:{free_port()}"
    group_flags = ["--num-processes", "2", "--coordinator-address", coordinator]
    single = Process(8, "--port", str(single_port))
    single.wait_ready()
    follower = Process(4, *group_flags, "--process-id", "1")
    leader = Process(4, *group_flags, "--process-id", "0", "--port", str(group_port))
    leader.wait_ready()
    urls = {
        "1 process x 8 devices": f"http://127.0.0.1:{single_port}",
        "2 processes x 4 devices": f"http://127.0.0.1:{group_port}",
    }
    periods: dict[str, list[float]] = {name: [] for name in urls}
    try:
        for url in urls.values():  # one warm-up round each
            decode_period(url, 24)
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            for name in order:
                periods[name].append(decode_period(urls[name], args.tokens))
                print(f"round {r}: {name}: {periods[name][-1] * 1e3:.1f} ms", flush=True)
    finally:
        single.stop()
        status = leader.stop()
        follower.proc.wait(timeout=120)
    sent = next((SENT_LINE.search(line) for line in leader.lines if SENT_LINE.search(line)), None)
    if status != 0 or sent is None:
        raise RuntimeError("process 0 did not stop cleanly:\n" + "\n".join(leader.lines[-30:]))
    messages, message_bytes, send_median_us, send_max_us = map(int, sent.groups())
    group_period = statistics.median(periods["2 processes x 4 devices"])
    single_period = statistics.median(periods["1 process x 8 devices"])
    channels = channel_costs(message_bytes, 200)
    headers = ["server", "decode period at batch 8, ms (range)", "plan send per step, us", "send / period"]
    rows = [
        [
            name,
            f"{statistics.median(p) * 1e3:.2f} ({min(p) * 1e3:.2f} .. {max(p) * 1e3:.2f})",
            "-" if name.startswith("1") else send_median_us,
            "-" if name.startswith("1") else f"{send_median_us / 1e6 / group_period:.2%}",
        ]
        for name, p in periods.items()
    ]
    results = {
        "rounds": args.rounds,
        "tokens": args.tokens,
        "flags": FLAGS,
        "periods_s": periods,
        "single_period_s": single_period,
        "group_period_s": group_period,
        "messages": messages,
        "message_bytes": message_bytes,
        "send_median_us": send_median_us,
        "send_max_us": send_max_us,
        "send_share_of_period": send_median_us / 1e6 / group_period,
        "channel_kv_us": channels["kv_us"],
        "channel_collective_us": channels["collective_us"],
        "load_average": [load_start, load_average()],
    }
    table = markdown_table(headers, rows)
    channel_table = markdown_table(
        ["channel", "one message, median us"],
        [
            ["coordination service key-value store (jaxserve's)", round(channels["kv_us"])],
            ["broadcast collective (multihost_utils.broadcast_one_to_all)", round(channels["collective_us"])],
        ],
    )
    summary = (
        f"{table}\n\nProcess 0 sent {messages} step messages of {message_bytes} B on average; send median "
        f"{send_median_us} us (max {send_max_us} us) = **{send_median_us / 1e6 / group_period:.2%}** of the group's "
        f"decode period at batch 8 (goal <= 5%).\n\nOne message of {message_bytes} B between two processes:\n\n"
        f"{channel_table}\n"
    )
    print(summary)
    write_results("multihost", results, summary)


if __name__ == "__main__":
    main()
