"""The `jaxserve` command: help and version, every EngineConfig field as a flag reaching the engine, `convert`, and
`jaxserve serve` as a real process that drains and exits 0 on SIGTERM."""

from __future__ import annotations

import codeop
import concurrent.futures
import dataclasses
import importlib
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import pytest

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.cli.main import (
    CHATTY_LIBRARIES,
    build_engine,
    configure_logging,
    engine_config,
    filled,
    parse,
    serve,
    server_config,
)
from jaxserve.config import EngineConfig, GroupConfig, step_policy_options
from jaxserve.runner.targets import CPU_COPY_ANALYSIS_FLAG, CPU_SMALL_LOOP_OPTION
from jaxserve.scheduler import PolicyContext, step_policies
from jaxserve.server.config import ServerConfig

cli_main = importlib.import_module("jaxserve.cli.main")  # the module (jaxserve.cli's `main` is the function)
JAXSERVE = str(Path(sys.executable).parent / "jaxserve")  # the console script pip installed
# The engine of tests/served_runner.py, as flags: its compiled shapes are then in the persistent cache.
SMALL = [
    "--no-mixed-batches",  # two fewer shapes to compile; mixed steps have their own tests (tests/test_engine.py)
    "--dtype",
    "float32",
    "--max-num-seqs",
    "4",
    "--chunked-prefill-size",
    "64",
    "--max-prefill-rows",
    "1",
    "--page-size",
    "16",
    "--max-model-len",
    "256",
]


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
    assert "--[no-]mixed-batches" in text or "--mixed-batches, --no-mixed-batches" in text
    assert "--scheduling-policy {fcfs,priority}" in text
    assert "[MODEL]" in text and "--gpu-memory-utilization FRACTION" in text and "--trust-remote-code" in text
    # `python -m jaxserve` is the same command.
    module = subprocess.run(
        [sys.executable, "-m", "jaxserve", "--help"], capture_output=True, text=True, timeout=120, env=cli_env()
    )
    assert module.returncode == 0 and module.stdout == result.stdout


@pytest.mark.parametrize(
    "argv, model",
    [
        (["serve", "/models/v4"], "/models/v4"),  # as `vllm serve MODEL`
        (["/models/v4", "--port", "0"], "/models/v4"),  # plain `jaxserve MODEL`
        (["serve", "--model", "/models/v4"], "/models/v4"),
        (["serve", "/models/v4/", "--model", "/models/v4"], "/models/v4/"),  # the same folder twice is fine
        (["serve"], None),
    ],
)
def test_the_model_is_positional_or_model(argv, model):
    _, args = parse(argv)
    assert engine_config(args).model == model and "model_tag" not in vars(args)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "/a", "--model", "/b"], "the model is given twice: MODEL '/a' and --model '/b'"),
        (
            ["serve", "--gpu-memory-utilization", "1.5"],
            "argument --gpu-memory-utilization: 1.5: must be a number in (0, 1]",
        ),
        (
            ["serve", "--gpu-memory-utilization", "0"],
            "argument --gpu-memory-utilization: 0.0: must be a number in (0, 1]",
        ),
        (["plan", "--gpu-memory-utilization", "most"], "argument --gpu-memory-utilization: 'most': not a number"),
        (["serve", "--max-num-seqs", "x"], "argument --max-num-seqs: invalid int value: 'x'"),  # argparse's own words
        (["plan", "--num-nodes", "0"], "argument --num-nodes: 0: must be a positive integer"),
        (["plan", "--devices-per-node", "x"], "argument --devices-per-node: invalid int value: 'x'"),
    ],
)
def test_bad_model_and_memory_flags_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_status:
        parse(argv)
    assert exit_status.value.code == 2 and message in capsys.readouterr().err


def test_trust_remote_code_is_accepted_with_one_line(capsys):
    for argv in (["serve", "--trust-remote-code"], ["generate", "Hi", "--trust-remote-code"]):
        _, args = parse(argv)
        assert engine_config(args) == EngineConfig()  # it sets nothing
        lines = capsys.readouterr().err.splitlines()
        assert lines == [
            "jaxserve: --trust-remote-code accepted; it changes nothing: jaxserve never runs code from a checkpoint"
        ]


@pytest.fixture
def restored_logging():
    """Put the process's logging back as it was after a test that configures it."""
    root = logging.getLogger()
    saved = root.level, root.handlers[:], {name: logging.getLogger(name).level for name in CHATTY_LIBRARIES}
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("level, libraries_info", [("info", False), ("warning", False), ("debug", True)])
def test_orbax_and_absl_info_lines_show_only_at_debug(level, libraries_info, restored_logging):
    configure_logging(level)
    ours = logging.getLogger("jaxserve.cli")
    assert (
        ours.isEnabledFor(logging.INFO) == (level != "warning") and ours.isEnabledFor(logging.DEBUG) == libraries_info
    )
    for name in ("absl", "orbax.checkpoint", "jax._src.xla_bridge"):  # orbax logs through absl's logger
        assert logging.getLogger(name).isEnabledFor(logging.INFO) == libraries_info
        assert logging.getLogger(name).isEnabledFor(logging.WARNING)


@pytest.mark.parametrize(
    "flags, policies",
    [
        ([], ["MixedSteps"]),  # the default protects streams: mixed steps
        (["--no-mixed-batches"], []),  # prefill-first (the benchmarks' baseline)
        (["--decode-interleave-every", "4"], ["DecodeInterleavePolicy"]),
        (["--max-decode-stall-ms", "50"], ["DecodeStallPolicy"]),
        (["--decode-interleave-every", "4", "--mixed-batches"], ["DecodeInterleavePolicy", "MixedSteps"]),
    ],
)
def test_scheduling_flags_compose_in_one_place(flags, policies):
    _, args = parse(["serve", *flags])
    cfg = engine_config(args)
    assert [type(p).__name__ for p in step_policies(cfg, PolicyContext(page_size=16, min_chunk_tokens=16))] == policies


def test_every_config_field_is_a_flag_with_the_same_default():
    command, args = parse([])
    assert command is serve  # plain `jaxserve` serves
    # EngineConfig.step_policies is filled by the step policies' own flags, one per option
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"step_policies"} | set(step_policy_options())
    server_fields = {f.name for f in dataclasses.fields(ServerConfig)}
    group_fields = {f.name for f in dataclasses.fields(GroupConfig)}
    # each flag fills one field of one config
    assert not engine_fields & server_fields and not (engine_fields | server_fields) & group_fields
    fields = engine_fields | server_fields | group_fields
    assert fields == set(vars(args)), f"fields without a flag: {fields - set(vars(args))}"
    assert engine_config(args) == EngineConfig() and server_config(args) == ServerConfig()
    assert filled(GroupConfig, args) == GroupConfig()


def test_flags_reach_the_engine():
    command, args = parse(
        [
            "serve",
            *SMALL,
            "--decode-interleave-every",
            "3",
            "--max-queued-requests",
            "5",
            "--num-kv-pages",
            "40",
            "--api-key",
            "k",
            "--port",
            "0",
            "--seed",
            "9",
            "--scheduling-policy",
            "priority",
        ]
    )
    cfg, server = engine_config(args), server_config(args)
    assert command is serve and (server.api_key, server.port, cfg.seed) == ("k", 0, 9)
    engine, loaded = build_engine(cfg)  # not started: nothing is compiled
    # The count keeps its own semantics: no mixed steps unless asked for too.
    assert [(type(p).__name__, p.every) for p in engine.scheduler.policies] == [("DecodeInterleavePolicy", 3)]
    assert type(engine.scheduler.prefill_manager.queue_order).__name__ == "Priority"
    assert engine.config.max_queued_requests == 5 and engine.max_model_len == 256
    assert (engine.geometry.num_slots, engine.geometry.num_pages, engine.geometry.page_size) == (4, 40, 16)
    assert engine.runner.buckets.prefill_chunks == (16, 64) and engine.runner.buckets.prefill_rows == (1,)
    assert loaded.config.dtype == "float32"


def test_a_bad_kv_cache_dtype_is_refused_naming_the_choices(capsys):
    for command in ("serve", "generate", "plan"):
        with pytest.raises(SystemExit) as exit_status:
            parse([command, *(["x"] if command == "generate" else []), "--kv-cache-dtype", "bogus"])
        assert exit_status.value.code == 2
        err = capsys.readouterr().err.replace("'", "")  # Python versions differ in quoting the choices
        assert "error: argument --kv-cache-dtype: invalid choice: bogus (choose from auto, bfloat16, fp8)" in err


def test_generate_has_the_engine_flags_but_not_the_server_ones():
    _, args = parse(["generate", "Hello", "--max-tokens", "5", "--decode-interleave-every", "2"])
    assert (args.prompt, args.max_tokens) == ("Hello", 5) and engine_config(args).step_policies == {
        "decode_interleave_every": 2
    }
    assert not hasattr(args, "port") and not hasattr(args, "api_key")


def test_generate_streams_one_prompt_to_the_terminal():
    result = run_cli(
        "generate", "Where does the river run?", "--max-tokens", "6", "--ignore-eos", "--chat", *SMALL, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[6 tokens in" in result.stderr and "finish reason: length" in result.stderr
    # Only what its one prompt needs: the chunk that holds the prompt and a one-row decode (of 5 shapes in all).
    assert "compiled 2 step shapes in" in result.stderr and "loading weights from" in result.stderr
    # stdout is the text alone, ended by a newline: the banner, the progress and the summary are on stderr. (The
    # trained default's reply may itself start with a newline.)
    text = result.stdout
    assert text.endswith("\n") and text.strip()
    for chatter in ("jaxserve", "loading", "compil", "KV cache", "tokens in"):
        assert chatter not in text, text


def test_generate_continues_python_code_with_and_without_drafts():
    """The trained default writes Python: `jaxserve generate "def fibonacci(n):"` (greedy) continues it with lines
    that read as Python (codeop: valid so far, perhaps unfinished), and drafting with its MTP block, or with the DSpark
    drafter kept beside it (checkpoints/default/dspark), gives the same."""
    texts = []
    for method, k in ((None, 0), ("mtp", 2), ("dspark", 5)):
        drafts = ["--speculative-config", json.dumps({"method": method, "num_speculative_tokens": k})] if method else []
        result = run_cli("generate", "def fibonacci(n):", "--max-tokens", "40", *SMALL, *drafts, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        texts.append(result.stdout)
    assert texts[0] == texts[1] == texts[2]
    source = "def fibonacci(n):" + texts[0]
    lines = source[: source.rindex("\n", 0, len(source) - 1) + 1]  # the whole lines (the last may be cut off)
    assert lines.count("\n") >= 3, source
    codeop.compile_command(lines, symbol="exec")  # a SyntaxError unless the lines read as Python
    assert re.search(r"\n {4}\S", lines), source  # an indented body


def test_a_split_the_mesh_cannot_make_is_refused_naming_axis_size_and_parallel_size(tmp_path):
    from jaxserve.checkpoints.writer import write_checkpoint
    from jaxserve.model.weights import init_weights
    from jaxserve.presets import preset

    cfg = preset("tiny", dtype="float32", num_attention_heads=6)  # every other sharded axis divides by 4
    folder = write_checkpoint(init_weights(jax.random.key(0), cfg), cfg, tmp_path / "six-heads", dtype="float32")
    result = run_cli(
        "serve", "--model", str(folder), "--dtype", "float32", "--tensor-parallel-size", "4", "--port", "0"
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = [line for line in result.stderr.splitlines() if "error" in line]
    assert "cannot split heads (6) over tensor_parallel_size=4" in line and "vocab" not in line
    assert "Traceback" not in result.stderr and "jaxserve ready" not in result.stdout


def test_convert(tmp_path):
    pytest.importorskip("jaxserve.checkpoints.orbax_io")
    from jaxserve.checkpoints.orbax_io import is_orbax_checkpoint

    command, args = parse(["convert", str(default_checkpoint_path()), str(tmp_path / "orbax"), "--dtype", "float32"])
    assert command(args) == 0 and is_orbax_checkpoint(tmp_path / "orbax")


def test_a_missing_model_folder_is_named():
    result = run_cli("--model", "/does/not/exist", "--port", "0")
    # The last line, and jaxserve's only one: before it JAX's CUDA plugin (the gpu-aot extra, which the test extra
    # installs) may log that this machine has no CUDA driver, which JAX_PLATFORMS=cpu does not silence.
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == "jaxserve: error: /does/not/exist: no such checkpoint folder"
    assert_one_clean_line(result, "jaxserve: error")


def assert_one_clean_line(result: subprocess.CompletedProcess | str, line_start: str) -> None:
    """Exit status of its own (not a signal's, not abort()'s 134) and one line saying why, with no traceback."""
    output = result if isinstance(result, str) else result.stdout + result.stderr
    assert sum(line.startswith(line_start) for line in output.splitlines()) == 1, output[-3000:]
    for crash in ("Traceback", "terminate called", "FATAL", "Fatal Python error", "Segmentation fault"):
        assert crash not in output, output[-3000:]


def test_a_taken_port_is_one_line_and_exit_status_1():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for _ in range(5):
            result = run_cli("serve", "--port", str(port), *SMALL)
            assert result.returncode == 1, result.stderr[-3000:]
            assert_one_clean_line(result, f"jaxserve: error: cannot listen on 127.0.0.1:{port}: Address already in use")
            assert "loading weights" not in result.stdout  # found before anything slow started


def test_sigint_during_compilation_exits_cleanly(tmp_path):
    # A fresh, empty compile cache each time, so the step shapes really are being compiled when SIGINT lands; two
    # servers at a time (the machine has two cores).
    def interrupted(i: int) -> str:
        process = ServeProcess(*SMALL, "--port", "0", compile_cache=tmp_path / f"cache{i}")
        try:
            process.wait_for_line("compiling ", 300)
            time.sleep(0.5 * i)  # land in different places: tracing, inside XLA, between shapes
            process.process.send_signal(signal.SIGINT)
            status = process.process.wait(timeout=300)
        finally:
            process.kill()
        process.reader.join(timeout=10)
        assert status == 1, "".join(process.output)[-3000:]
        return "".join(process.output)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for output in pool.map(interrupted, range(5)):
            assert_one_clean_line(output, "jaxserve: SIGINT during start-up: stopping")
            assert "jaxserve ready" not in output


def test_a_second_sigint_quits_at_once(tmp_path):
    process = ServeProcess(*SMALL, "--port", "0", compile_cache=tmp_path / "cache")
    try:
        process.wait_for_line("compiling ", 300)
        time.sleep(1.0)  # tracing done: inside XLA's compile, where the first SIGINT waits for the shape to finish
        process.process.send_signal(signal.SIGINT)
        process.wait_for_line("jaxserve: SIGINT during start-up", 30)
        process.process.send_signal(signal.SIGINT)
        status = process.process.wait(timeout=30)
    finally:
        process.kill()
    process.reader.join(timeout=10)
    output = "".join(process.output)
    assert status == 1, output[-3000:]
    # Whichever came first, the end of the shape or the second signal, the exit is clean; if the second won, it
    # said so in one line.
    assert_one_clean_line(output, "jaxserve: SIGINT during start-up")
    assert sum(line.startswith("jaxserve: second SIGINT: quitting now") for line in output.splitlines()) <= 1


def test_ctrl_c_once_ready_does_not_wait_for_the_shapes_still_compiling(tmp_path):
    # A fresh compile cache, so the other step shapes really are compiling when SIGINT lands; a compile in progress
    # cannot be interrupted, so waiting for it would take about one shape's compile (the first two took `startup`).
    process = ServeProcess(*SMALL, "--port", "0", compile_cache=tmp_path / "cache")
    try:
        process.wait_for_line("jaxserve ready on ", 600)
        process.process.send_signal(signal.SIGINT)
        sent = time.perf_counter()
        status = process.process.wait(timeout=120)
        seconds = time.perf_counter() - sent
    finally:
        process.kill()
    process.reader.join(timeout=10)
    output = "".join(process.output)
    startup = float(re.search(r"compiled 2 step shapes in ([\d.]+) s", output).group(1))
    assert status == 0, output[-3000:]  # a shutdown once serving
    assert "compiled all" not in output and seconds < startup / 4, (seconds, startup, output[-3000:])
    assert_one_clean_line(output, "jaxserve ready on ")


class ServeProcess:
    """`jaxserve serve` as a child process; its output is collected by a thread so the pipe never fills."""

    def __init__(self, *flags: str, compile_cache: Path | None = None, env: dict[str, str] | None = None):
        env = env or cli_env()
        if compile_cache is not None:
            env = {**env, "JAXSERVE_COMPILE_CACHE": str(compile_cache)}
        self.process = subprocess.Popen(
            [JAXSERVE, "serve", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.output: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

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
    """Also the start-up story and the log, as an operator capturing the output to a file sees them."""
    serve_process = ServeProcess(*SMALL, "--port", "0", "--shutdown-timeout", "60")
    try:
        ready = serve_process.wait_for_line("jaxserve ready on http://127.0.0.1:", 600)
        url = ready.split()[3]
        # Ready after the two shapes that serve one request at a time; the other three compile while serving.
        assert httpx.get(url + "/health").status_code == 200
        serve_process.wait_for_line("compiled all 5 step shapes", 600)
        output = "".join(serve_process.output)
        assert (
            "KV cache (float32): 64 pages x 16 tokens = 1024 tokens; max concurrency at max_model_len (256 tokens): 4"
            in output
            and "prefix caching: on, 4 snapshots of the sequence state (" in output
            and "compiled 2 step shapes in" in output
        )

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
        statuses = []
        while serve_process.process.poll() is None and 503 not in statuses:
            try:
                statuses.append(httpx.get(url + "/health", timeout=5).status_code)
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

    serve_process.reader.join(timeout=10)
    log = "".join(serve_process.output)
    assert "\r" not in log and "libtpu" not in log and "Unable to initialize backend" not in log
    assert_one_clean_line(log, "loading weights: 150/150 (100%)")
    lines = log.splitlines()
    listening = next(i for i, line in enumerate(lines) if line.startswith("listening on " + url))
    ready = next(i for i, line in enumerate(lines) if line.startswith("jaxserve ready on " + url))
    assert listening < ready and not any("Uvicorn running" in line for line in lines)
    # The access log: one line per request, with its status, token counts and time.
    access = [line for line in lines if " jaxserve.access: " in line]
    completions = [line for line in access if '"POST /v1/completions" 200 ' in line]
    assert len(completions) == 4 and all(
        re.search(r"prompt_tokens=3 completion_tokens=250 \d+\.\d+ s$", line) for line in completions
    ), completions
    health = [line for line in access if '"GET /health" ' in line]
    assert [int(line.split('"GET /health" ')[1].split()[0]) for line in health] == [200, *statuses], health
    assert len(access) == 4 + len(health)


def test_the_command_tunes_xla_cpu_before_any_backend_starts(monkeypatch):
    """`jaxserve` adds XLA:CPU's small-loop threshold and copy insertion's region analysis to XLA_FLAGS before any
    backend starts (jaxserve.runner.targets): beside the user's other flags and backend options, never over the
    user's own value for either."""
    key, value = CPU_SMALL_LOOP_OPTION
    seen = []
    monkeypatch.setattr(cli_main, "parse", lambda argv: (lambda args: seen.append(os.environ["XLA_FLAGS"]) or 0, None))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert cli_main.main([]) == 0
    option = f"--xla_backend_extra_options={key}={value}"
    assert seen[-1].split() == ["--xla_force_host_platform_device_count=8", option, CPU_COPY_ANALYSIS_FLAG]
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_extra_options=xla_cpu_disable_loop_unrolling")
    cli_main.main([])
    assert seen[-1].split() == [
        f"--xla_backend_extra_options=xla_cpu_disable_loop_unrolling,{key}={value}",
        CPU_COPY_ANALYSIS_FLAG,
    ]
    users = f"--xla_backend_extra_options=a=1,{key}=0 --xla_cpu_copy_insertion_use_region_analysis=false"
    monkeypatch.setenv("XLA_FLAGS", users)
    cli_main.main([])
    assert seen[-1] == users
