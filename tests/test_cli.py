"""The `jaxserve` command: help and version, every EngineConfig field as a flag reaching the engine, `convert`, and
`jaxserve serve` as a real process that drains and exits 0 on SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import pytest

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.cli.main import build_engine, engine_config, parse, serve
from jaxserve.config import EngineConfig

JAXSERVE = str(Path(sys.executable).parent / "jaxserve")  # the console script pip installed
# The engine of tests/test_server.py, as flags: its compiled shapes are then in the persistent cache.
SMALL = ["--dtype", "float32", "--max-num-seqs", "4", "--chunked-prefill-size", "64", "--max-prefill-rows", "1",
         "--page-size", "16", "--max-model-len", "256"]


def cli_env() -> dict[str, str]:
    """This process's environment (8 fake CPU devices), with the tests' persistent compilation cache."""
    return {**os.environ, "JAXSERVE_COMPILE_CACHE": jax.config.jax_compilation_cache_dir or ""}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([JAXSERVE, *args], capture_output=True, text=True, timeout=timeout, env=cli_env())


def test_help_explains_decode_interleave_every():
    result = run_cli("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # undo argparse's line wrapping
    assert "--decode-interleave-every N" in text
    assert "first token" in text and "wait less for their next token" in text  # the trade-off
    assert "(N+1) x t_chunk + t_decode" in text  # the stall bound
    assert "jaxserve generate" in text and "jaxserve convert" in text
    assert run_cli("--version").stdout.strip() == "jaxserve 0.1.0"


def test_every_engine_config_field_is_a_flag_with_the_same_default():
    command, args = parse([])
    assert command is serve  # plain `jaxserve` serves
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert fields <= set(vars(args)), f"fields without a flag: {fields - set(vars(args))}"
    assert engine_config(args) == EngineConfig()


def test_flags_reach_the_engine():
    command, args = parse(["serve", *SMALL, "--decode-interleave-every", "3", "--max-queued-requests", "5",
                           "--num-kv-pages", "40", "--api-key", "k", "--port", "0", "--seed", "9"])
    cfg = engine_config(args)
    assert command is serve and (cfg.api_key, cfg.port, cfg.seed) == ("k", 0, 9)
    engine, loaded = build_engine(cfg)  # not started: nothing is compiled
    assert engine.scheduler.interleave_policy.every == 3
    assert engine.config.max_queued_requests == 5 and engine.max_model_len == 256
    assert (engine.geometry.num_slots, engine.geometry.num_pages, engine.geometry.page_size) == (4, 40, 16)
    assert engine.runner.buckets.prefill_chunks == (16, 64) and engine.runner.buckets.prefill_rows == (1,)
    assert loaded.config.dtype == "float32"


def test_generate_has_the_engine_flags_but_not_the_server_ones():
    _, args = parse(["generate", "Hello", "--max-tokens", "5", "--decode-interleave-every", "2"])
    assert (args.prompt, args.max_tokens) == ("Hello", 5) and engine_config(args).decode_interleave_every == 2
    assert not hasattr(args, "port") and not hasattr(args, "api_key")


def test_generate_streams_one_prompt_to_the_terminal():
    result = run_cli("generate", "Where does the river run?", "--max-tokens", "6", "--ignore-eos", "--chat", *SMALL,
                     timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[6 tokens in" in result.stderr and "finish reason: length" in result.stderr
    assert "compiled 5 step shapes in" in result.stdout


def test_a_split_the_mesh_cannot_make_is_refused_naming_axis_size_and_parallel_size(tmp_path):
    from jaxserve.checkpoints.writer import write_checkpoint
    from jaxserve.model.weights import init_weights
    from jaxserve.presets import preset

    cfg = preset("tiny", dtype="float32", num_attention_heads=6)  # every other sharded axis divides by 4
    folder = write_checkpoint(init_weights(jax.random.key(0), cfg), cfg, tmp_path / "six-heads", dtype="float32")
    result = run_cli("serve", "--model", str(folder), "--dtype", "float32", "--tensor-parallel-size", "4",
                     "--port", "0")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = [line for line in result.stderr.splitlines() if "error" in line]
    assert "cannot split heads (6) over tensor_parallel_size=4" in line and "vocab" not in line
    assert "Traceback" not in result.stderr and "jaxserve ready" not in result.stdout


def test_convert(tmp_path):
    pytest.importorskip("jaxserve.checkpoints.orbax_io")
    from jaxserve.checkpoints.orbax_io import is_orbax_checkpoint

    command, args = parse(["convert", str(default_checkpoint_path()), str(tmp_path / "orbax"), "--dtype",
                           "float32"])
    assert command(args) == 0 and is_orbax_checkpoint(tmp_path / "orbax")


class ServeProcess:
    """`jaxserve serve` as a child process; its output is collected by a thread so the pipe never fills."""

    def __init__(self, *flags: str):
        self.process = subprocess.Popen([JAXSERVE, "serve", *flags], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=cli_env())
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for_line(self, prefix: str, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no line starting with {prefix!r}; output:\n{''.join(self.output)[-3000:]}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def test_sigterm_drains_running_requests_and_exits_zero():
    serve_process = ServeProcess(*SMALL, "--port", "0", "--shutdown-timeout", "60")
    try:
        ready = serve_process.wait_for_line("jaxserve ready on http://127.0.0.1:", 600)
        url = ready.split()[3]
        output = "".join(serve_process.output)
        assert "KV cache: 64 pages x 16 tokens = 1024 tokens; max concurrency at max_model_len (256 tokens): 4" \
            in output and "compiled 5 step shapes in" in output
        assert httpx.get(url + "/health").status_code == 200

        streams: list[list[dict]] = []
        started = threading.Semaphore(0)

        def stream(prompt: list[int]) -> None:
            body = {"prompt": prompt, "max_tokens": 250, "ignore_eos": True, "stream": True}
            chunks = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        if len(chunks) == 1:
                            started.release()
            streams.append(chunks)

        clients = [threading.Thread(target=stream, args=([5 + i, 6, 7],)) for i in range(4)]
        for client in clients:
            client.start()
        for _ in clients:  # the drain must find all four running
            assert started.acquire(timeout=120)
        serve_process.process.send_signal(signal.SIGTERM)
        statuses = set()
        while serve_process.process.poll() is None and 503 not in statuses:
            try:
                statuses.add(httpx.get(url + "/health", timeout=5).status_code)
            except httpx.TransportError:
                break  # already gone
        assert 503 in statuses  # draining: not ready, but still answering
        for client in clients:
            client.join(timeout=120)
        assert serve_process.process.wait(timeout=60) == 0
    finally:
        serve_process.kill()
    assert len(streams) == 4
    for chunks in streams:  # every running request was let finish
        assert len(chunks) == 250 and chunks[-1]["choices"][0]["finish_reason"] == "length"
