"""Multi-controller serving (docs/architecture.md, "Several hosts"): two `jaxserve serve` processes of 4 CPU devices
each (gloo collectives) serve one global mesh of TP 2 x EP 4 through process 0's HTTP API, with the same tokens and
logprobs as one process of 8 devices; a lost process stops the group within a bounded time; the flags are checked.
The replay itself (jaxserve.runner.mirror) is also checked in one process: a second runner fed only process 0's
calls ends with the same device state."""

from __future__ import annotations

import concurrent.futures
import json
import pickle
import queue
import re
import signal
import socket
import subprocess
import time

import httpx
import jax
import numpy as np
import pytest
from test_cli import JAXSERVE, SMALL, ServeProcess, cli_env

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.cli.main import build_engine, engine_config, parse
from jaxserve.config import ConfigError, GroupConfig
from jaxserve.request import SamplingParams
from jaxserve.runner import ModelRunner
from jaxserve.runner.group import CompiledEverywhere, CoordinationChannel, GroupLost, ProcessGroup
from jaxserve.runner.mirror import CallLog, Follower, ForwardCall

PARALLEL = ["--tensor-parallel-size", "2", "--expert-parallel-size", "4"]
# The tests' small engine (test_cli.SMALL) cut to three step shapes (one chunk of 16, decodes of 1 and 2 rows), since
# each process of a group compiles every shape: the prompts fit one chunk, and 4 requests on 2 slots still share
# steps and wait for each other.
FLAGS = [*SMALL, "--max-num-seqs", "2", "--chunked-prefill-size", "16", *PARALLEL]
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 7, 200, 11, 12, 13, 14, 15, 16, 17], [300, 301]]
MAX_TOKENS = 24


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def four_device_env() -> dict[str, str]:
    env = cli_env()
    flags = [flag for flag in env["XLA_FLAGS"].split() if not flag.startswith("--xla_force_host_platform_device_count")]
    return {**env, "XLA_FLAGS": " ".join([*flags, "--xla_force_host_platform_device_count=4"])}


def start_group(*model: str) -> tuple[str, ServeProcess, ServeProcess]:
    """Process 1 and process 0 (HTTP) of a group of 2 on `model` (default: the embedded one), once every step shape
    is compiled: (url, process 0, process 1)."""
    group_flags = ["--num-processes", "2", "--coordinator-address", f"127.0.0.1:{free_port()}"]
    flags = [*model, *FLAGS, *group_flags, "--distributed-timeout", "120"]
    follower = ServeProcess(*flags, "--process-id", "1", env=four_device_env())
    leader = ServeProcess(*flags, "--process-id", "0", "--port", "0", env=four_device_env())
    try:
        ready = leader.wait_for_line("jaxserve ready on http://127.0.0.1:", 900)
        leader.wait_for_line("compiled all 3 step shapes", 900)  # the concurrent requests below use every shape
    except BaseException:
        leader.kill()
        follower.kill()
        raise
    return ready.split()[3], leader, follower


@pytest.fixture(scope="module")
def group():
    url, leader, follower = start_group()
    try:
        yield url, leader, follower
    finally:
        leader.kill()
        follower.kill()


@pytest.fixture(scope="module")
def expected() -> list[tuple[list[int], list[float]]]:
    return reference_outputs()


def reference_outputs() -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs from one process of 8 devices, TP 2 x EP 4, the same flags."""
    _, args = parse(FLAGS)
    engine, _ = build_engine(engine_config(args))
    engine.runner.warmup()
    engine.start()
    try:
        outputs = []
        for prompt in PROMPTS:
            handle = engine.submit(
                prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=3, ignore_eos=True)
            )
            tokens, logprobs = [], []
            for event in handle.sync_events(timeout=300):
                tokens += event.token_ids
                logprobs += [lp.logprob for lp in event.logprobs or ()]
            outputs.append((tokens, logprobs))
        return outputs
    finally:
        engine.shutdown()


def completion(url: str, prompt: list[int], stream: bool) -> tuple[list[int], list[float], list[dict]]:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 3,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"], [response.json()]
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    choices = [chunk["choices"][0] for chunk in chunks if chunk.get("choices")]
    tokens = [t for choice in choices for t in choice.get("token_ids") or ()]
    logprobs = [lp for choice in choices if choice.get("logprobs") for lp in choice["logprobs"]["token_logprobs"]]
    return tokens, logprobs, chunks


def test_two_processes_serve_what_one_process_of_eight_devices_serves(group, expected):
    url, leader, follower = group
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: they share steps
        futures = [pool.submit(completion, url, prompt, i % 2 == 0) for i, prompt in enumerate(PROMPTS)]
        served = [future.result(timeout=600) for future in futures]
    for (tokens, logprobs, _), (want_tokens, want_logprobs) in zip(served, expected):
        assert len(tokens) == MAX_TOKENS and tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
    assert httpx.get(url + "/health").status_code == 200
    # Every process read only the routed experts its devices hold (the other half is the other process's).
    for process in (leader, follower):
        assert any("read 4 of 8 routed experts in each of" in line for line in process.output), process.output[-20:]
    assert any(line.startswith("process 1 of 2: replaying process 0's steps") for line in follower.output)
    assert not any("jaxserve ready" in line or "listening on" in line for line in follower.output)


def test_killing_process_1_mid_stream_ends_the_stream_with_an_error_and_process_0_within_15_s(group):
    url, leader, follower = group
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:  # streaming has started
            if line.startswith("data: {"):
                events.append(line)
                break
        follower.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        events += [line for line in lines if line.startswith("data: ")]
    status = leader.process.wait(timeout=30)
    seconds = time.monotonic() - killed
    assert status == 1 and seconds < 15, (status, seconds)
    errors = [json.loads(line[6:])["error"] for line in events if line.startswith('data: {"error"')]
    assert len(errors) == 1 and "lost process 1 of the group of 2" in errors[0]["message"], events[-3:]
    assert events[-1] == "data: [DONE]"
    leader.reader.join(timeout=10)
    assert any(line.startswith("jaxserve: error: lost process 1 of the group of 2") for line in leader.output)


def test_an_orbax_conversion_serves_and_sigterm_stops_every_process_with_status_0(tmp_path, expected):
    """Each process restores only its shards of an orbax conversion; SIGTERM to process 0 drains it, tells process 1
    to stop, and both exit 0."""
    convert = subprocess.run(
        [JAXSERVE, "convert", str(default_checkpoint_path()), str(tmp_path / "orbax"), "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert convert.returncode == 0, convert.stderr
    url, leader, follower = start_group(str(tmp_path / "orbax"))
    try:
        tokens, logprobs, _ = completion(url, PROMPTS[2], stream=False)
        assert tokens == expected[2][0]
        np.testing.assert_allclose(logprobs, expected[2][1], atol=1e-4)
        leader.process.send_signal(signal.SIGTERM)
        statuses = leader.process.wait(timeout=60), follower.process.wait(timeout=60)
    finally:
        leader.kill()
        follower.kill()
    leader.reader.join(timeout=10)
    follower.reader.join(timeout=10)
    assert statuses == (0, 0), f"process 0's last lines: {leader.output[-15:]}\nprocess 1's: {follower.output[-15:]}"
    assert any(line.startswith("sent ") and " step messages to the other processes" in line for line in leader.output)
    assert any(line.startswith("process 1: process 0 stopped;") for line in follower.output), follower.output[-5:]


def test_process_0_alone_fails_with_one_line_within_its_timeout():
    started = time.monotonic()
    result = subprocess.run(
        [JAXSERVE, "serve", *PARALLEL, "--num-processes", "2", "--process-id", "0"]
        + ["--coordinator-address", f"127.0.0.1:{free_port()}", "--distributed-timeout", "3", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=four_device_env(),
    )
    assert result.returncode == 1 and time.monotonic() - started < 20
    ours = [line for line in result.stderr.splitlines() if line.startswith("jaxserve: error:")]
    assert ours == [
        "jaxserve: error: the process group (--num-processes 2, coordinator "
        + ours[0].split("coordinator ")[1].split(")")[0]
        + ") was not complete after 3 s (--distributed-timeout): start every process with the same --num-processes "
        "and --coordinator-address, each with its own --process-id"
    ], result.stderr[-2000:]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_processes=2), "give every process --process-id (0 .. 1) and the same --coordinator-address"),
        (dict(num_processes=2, process_id=2, coordinator_address="h:1"), "process_id=2: must be in [0, 2)"),
        (dict(num_processes=2, process_id=0, coordinator_address="nowhere"), "must be HOST:PORT"),
        (dict(process_id=1), "--process-id and --coordinator-address need --num-processes"),
        (dict(num_processes=0), "num_processes=0: must be a positive integer"),
        (dict(distributed_timeout=0), "distributed_timeout=0: must be positive"),
    ],
)
def test_bad_group_flags_are_refused_naming_them(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        GroupConfig(**fields)


def test_group_flags_are_serve_flags():
    _, args = parse(["--num-processes", "2", "--process-id", "1", "--coordinator-address", "h:5"])
    assert (args.num_processes, args.process_id, args.coordinator_address) == (2, 1, "h:5")
    result = subprocess.run([JAXSERVE, "generate", "x", "--num-processes", "2"], capture_output=True, text=True)
    assert result.returncode == 2 and "unrecognized arguments: --num-processes" in result.stderr


class QueueChannel:
    """Process 0's messages in memory, each also kept in `sent`."""

    def __init__(self):
        self.messages: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.sent: list[bytes] = []

    def send(self, payload: bytes) -> None:
        self.messages.put(payload)
        self.sent.append(payload)

    def receive(self) -> bytes | None:
        try:
            return self.messages.get(timeout=0.1)
        except queue.Empty:
            return None


def test_a_follower_fed_only_process_0s_calls_ends_with_process_0s_device_state():
    """In one process: the leader's engine serves (prefill and decode steps, greedy, sampled and penalized rows,
    the warm-ups' padding runs) while its calls go into a log; a second runner replaying that log ends with the same
    cache and slot tokens, bit for bit. A call replayed out of turn is refused. The leader runs no step shape before
    the follower said it compiled it (its first run is its first collectives, which gloo gives a peer 30 s to join)."""
    _, args = parse(SMALL)
    engine, loaded = build_engine(engine_config(args))
    leader = engine.runner
    assert isinstance(leader, ModelRunner)
    replica = ModelRunner(leader.cfg, loaded.weights, leader.geometry, leader.mesh, leader.buckets)
    channel, client = QueueChannel(), FakeClient(2)
    leader.mirror = CallLog(channel)
    leader.compile_sync = CompiledEverywhere(ProcessGroup(client, 0, 2), timeout_s=0.1)
    replica.compile_sync = CompiledEverywhere(ProcessGroup(client, 1, 2), timeout_s=0.1)
    first = leader.buckets.shapes()[0].key  # warmup()'s first
    with pytest.raises(GroupLost, match=f"process 1 did not compile step shape {re.escape(first)} within 0.1 s"):
        leader.warmup()
    assert channel.sent == [] and not client.store  # nothing ran, and process 0 says nothing of its compiles
    replica.compile_ahead()
    assert len(client.store) == len(leader.buckets.shapes())
    leader.warmup()
    engine.start()
    try:
        samplings = [
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0.8, seed=3, ignore_eos=True),
            SamplingParams(
                max_tokens=7, temperature=1.0, seed=4, presence_penalty=1.5, repetition_penalty=1.3, ignore_eos=True
            ),
        ]
        handles = [engine.submit(prompt, sampling) for prompt, sampling in zip(PROMPTS, samplings)]
        for handle in handles:
            assert handle.wait(timeout=300)[1] == "length"
    finally:
        engine.shutdown()
    leader.mirror.stop()
    follower = Follower(replica, channel)
    follower.run()
    assert follower.replayed > 20 and not leader.mirror.pending
    assert len(channel.sent) == len(leader.mirror.send_seconds)  # one message per forward, and the stop
    same = jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
        (leader.cache, leader.slot_tokens),
        (replica.cache, replica.slot_tokens),
    )
    assert all(jax.tree.leaves(same))
    first = pickle.loads(channel.sent[0])[0]
    assert isinstance(first, ForwardCall) and first.number == 0
    with pytest.raises(RuntimeError, match="out of step"):
        replica.replay(first)


class FakeClient:
    """The parts of jax's coordination client the group uses, in memory; `live` is who still sends heartbeats."""

    def __init__(self, num_processes: int):
        self.live = set(range(num_processes))
        self.store: dict[str, bytes] = {}
        self.unreachable = False

    def get_live_nodes(self, nodes):
        if self.unreachable:
            raise RuntimeError("UNAVAILABLE: failed to connect")
        return {n: 1 for n in nodes if n in self.live}

    def key_value_set_bytes(self, key, value):
        self.store[key] = value

    key_value_set = key_value_set_bytes

    def blocking_key_value_get(self, key, timeout_ms):
        return self.blocking_key_value_get_bytes(key, timeout_ms)

    def key_value_delete(self, key):
        del self.store[key]

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if self.unreachable:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        if key not in self.store:
            raise RuntimeError("DEADLINE_EXCEEDED: Deadline Exceeded")
        return self.store[key]


def watched(client: FakeClient, busy_since=lambda: None, step_timeout_s: float = 60.0) -> str:
    lost: queue.SimpleQueue[str] = queue.SimpleQueue()
    ProcessGroup(client, 0, 3).watch(lost.put, busy_since, step_timeout_s)
    return lost.get(timeout=10)


def test_the_watch_names_a_lost_process_an_unreachable_service_and_a_hung_step():
    client = FakeClient(3)
    client.live.discard(2)
    assert watched(client) == (
        "lost process 2 of the group of 3: no heartbeat for 10 s (it died, hung, or its host is unreachable)"
    )
    client = FakeClient(3)
    client.unreachable = True
    assert watched(client).startswith("the coordination service (process 0) cannot be reached: UNAVAILABLE")
    since = time.monotonic() - 5
    assert watched(FakeClient(3), lambda: since, step_timeout_s=2).startswith("a step has waited 5 s for the group")
    assert ProcessGroup(FakeClient(3), 0, 3).lost_line(wait_s=0.6).startswith("no process is reported lost")


def test_the_channel_delivers_in_order_keeps_the_store_small_and_tells_a_wait_from_a_loss():
    client = FakeClient(2)
    leader, follower = CoordinationChannel(client), CoordinationChannel(client)
    assert follower.receive() is None  # nothing sent yet: ask again
    for i in range(40):
        leader.send(f"message {i}".encode())
        assert follower.receive() == f"message {i}".encode()
    assert len(client.store) == CoordinationChannel.KEEP
    client.unreachable = True
    with pytest.raises(GroupLost, match="cannot be reached"):
        follower.receive()


def test_a_launchers_environment_makes_the_group_without_flags():
    """Slurm's srun variables (as jax.distributed reads them) make process 0 wait for a group of 2 with no group flag:
    alone, it gives up after --distributed-timeout, naming the launcher."""
    slurm = {
        "SLURM_JOB_ID": "1234",  # jax takes port 61440 + the job id mod 4096: outside Linux's ephemeral ports
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    result = subprocess.run(
        [JAXSERVE, "serve", *PARALLEL, "--distributed-timeout", "3", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**four_device_env(), **slurm},
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "jaxserve: error: the process group (SlurmCluster's environment, 2 processes, coordinator from the " in (
        result.stderr
    )
