"""A real `jaxserve serve` in a subprocess and a streaming client: what the end-to-end benchmarks measure against.

server = Server(["--max-num-seqs", "2", ...], cpus)    # ready once it logs that every step shape compiled
stream(server.url, prompt, max_tokens, stamps)         # each streamed chunk's arrival time into `stamps`
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from common import REPO


@contextmanager
def on_cpus(cpus: set[int] | None):
    """Run the block (and any process it starts, which inherits the mask) on `cpus`."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The line a server prints once every step shape is compiled (a server is ready before that and compiles the rest
# while serving): the rows compare policies at full chunk size.
COMPILED_ALL = "compiled all "


class Server:
    """`jaxserve serve` (or another `command` that takes --host and --port) in a subprocess, ready once it prints a
    line starting with `ready_line`; its log lines are kept, stamped on arrival, for the step timings."""

    def __init__(
        self,
        flags: list[str] | tuple[str, ...],
        cpus: set[int] | None = None,
        command: str = "serve",
        ready_line: str = COMPILED_ALL,
    ):
        self.port = free_port()
        cmd = [sys.executable, "-m", "jaxserve.cli", command, "--host", "127.0.0.1", "--port", str(self.port), *flags]
        with on_cpus(cpus):
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.lines: list[tuple[float, str]] = []
        ready = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.lines.append((time.perf_counter(), line.rstrip()))
                if line.startswith(ready_line):
                    ready.set()
            ready.set()  # the process ended

        threading.Thread(target=pump, daemon=True).start()
        ready.wait(timeout=900)
        if self.proc.poll() is not None or not ready.is_set():
            self.stop()
            raise RuntimeError(
                f"jaxserve {command} {' '.join(flags)} did not become ready:\n"
                + "\n".join(line for _, line in self.lines[-30:])
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---- the client side --------------------------------------------------------------------------------------------


def stream(url: str, prompt: list[int], max_tokens: int, stamps: list[float]) -> None:
    """One greedy completion of `max_tokens` streamed; each chunk's arrival time appended to `stamps` as it comes (the
    starvation experiment's attacker waits for the victim's first tokens)."""
    for stamp, _ in _chunks(url, prompt, max_tokens):
        stamps.append(stamp)


def streamed_tokens(url: str, prompt: list[int], max_tokens: int) -> list[tuple[float, list[int]]]:
    """One greedy completion of `max_tokens` streamed: (arrival time, the token ids it carries) per chunk (a verify
    step with drafts delivers several tokens at once)."""
    return list(_chunks(url, prompt, max_tokens))


def _chunks(url: str, prompt: list[int], max_tokens: int) -> Iterator[tuple[float, list[int]]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=None) as client,
        client.stream("POST", f"{url}/v1/completions", json={**body, "return_token_ids": True}) as reply,
    ):
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices")
            if choices:
                yield time.perf_counter(), list(choices[0].get("token_ids") or ())
