"""The process group of multi-controller serving: joining it (jax.distributed), the channel process 0's calls travel
on, and the watch that stops the group when a process is lost (docs/architecture.md, "Several hosts").

Every process runs `jaxserve serve` with the same flags but its `--process-id` (or under a launcher whose environment
jax.distributed reads: Slurm's srun, Open MPI's mpirun, Kubernetes). They meet at process 0's coordination service;
after that the collectives of each step run between the devices (NCCL on GPUs, gloo between CPU processes).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from jaxserve.config import GroupConfig

log = logging.getLogger("jaxserve.group")

# A process whose coordination client sends no heartbeat for this long is lost (jax's default, 100 s, would keep a
# client waiting on a dead group for minutes). The heartbeats come from the client's own thread, never held up by a
# long compile or a Python pause.
HEARTBEAT_TIMEOUT_S = 10
# How often the watch asks the coordination service which processes are alive.
WATCH_INTERVAL_S = 0.5
# How long a clean shutdown waits for every process to reach it (process 0 stops; the others heard it), and how long
# process 0's coordination service outlives the clients' disconnects (ProcessGroup.stop).
STOP_TIMEOUT_S = 30
STOP_GRACE_S = 1.0
# The launchers whose environment jax.distributed.initialize() reads when no flag says the group.
LAUNCHERS = ("SlurmCluster", "OmpiCluster", "K8sCluster")


class GroupLost(RuntimeError):
    """A process of the group is gone (or unreachable): the group cannot run another step."""


def launcher_process_count() -> tuple[str, int] | None:
    """(launcher, processes) when this process runs under a launcher jax.distributed reads, None otherwise."""
    from jax._src import clusters  # where jax keeps its launcher detection (no public name for it)

    for cluster in clusters.ClusterEnv._cluster_types:
        if cluster.__name__ not in LAUNCHERS:
            continue
        try:
            if cluster.is_env_present():
                return cluster.__name__, int(cluster.get_process_count())
        except Exception:  # noqa: BLE001 - a launcher's detection that fails (a missing client library) is no launcher
            continue
    return None


def join(cfg: GroupConfig) -> ProcessGroup | None:
    """Join the group `cfg` (or a launcher's environment) describes, before anything starts JAX's backend; None
    when this is a single process. A group that is not complete within --distributed-timeout ends this process
    with one line saying so (exit 1), rather than jax's abort."""
    if cfg.num_processes is None:
        launcher = launcher_process_count()
        if launcher is None or launcher[1] <= 1:
            return None
        what = f"{launcher[0]}'s environment, {launcher[1]} processes"
        arguments: dict[str, Any] = {}
    elif cfg.num_processes == 1:
        return None
    else:
        what = f"--num-processes {cfg.num_processes}"
        arguments = dict(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
        )
    # Between CPU processes the collectives go over gloo (GPUs use NCCL whatever this says).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A lost process must not abort the others from inside jax: process 0 ends its requests and says what happened.
    jax.config.update("jax_enable_recoverability", True)
    joined = threading.Event()

    def give_up() -> None:
        if joined.is_set():
            return
        print(
            f"jaxserve: error: the process group ({what}, coordinator {cfg.coordinator_address or 'from the launcher'}"
            f") was not complete after {cfg.distributed_timeout:g} s (--distributed-timeout): start every process "
            "with the same --num-processes and --coordinator-address, each with its own --process-id",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    deadline = threading.Timer(cfg.distributed_timeout, give_up)
    deadline.daemon = True
    deadline.start()
    # jax's own deadline comes later than ours, so ours is the one that speaks.
    jax.distributed.initialize(
        **arguments,
        initialization_timeout=int(cfg.distributed_timeout) + 30,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )
    joined.set()
    deadline.cancel()
    from jax._src.distributed import global_state  # the client jax.distributed made (no public name for it)

    group = ProcessGroup(global_state.client, jax.process_index(), jax.process_count())
    log.info("joined the process group as process %d of %d (%s)", group.process_id, group.num_processes, what)
    return group


@dataclass
class ProcessGroup:
    """This process's place in the group, and the coordination service's client it talks to the others through."""

    client: Any  # jax's DistributedRuntimeClient
    process_id: int
    num_processes: int
    _channel: CoordinationChannel | None = field(default=None, init=False)
    _leaving: threading.Event = field(default_factory=threading.Event, init=False)
    _watches: list[threading.Thread] = field(default_factory=list, init=False)

    @property
    def leader(self) -> bool:
        return self.process_id == 0

    @property
    def channel(self) -> CoordinationChannel:
        if self._channel is None:
            self._channel = CoordinationChannel(self.client)
        return self._channel

    def loss(self) -> str | None:
        """What the coordination service says is lost: processes it no longer hears from, or itself, unreachable;
        None while every process is alive."""
        try:
            live = self.client.get_live_nodes(list(range(self.num_processes)))
        except Exception as error:  # noqa: BLE001 - any failure to reach the service loses the group
            return f"the coordination service (process 0) cannot be reached: {error}"
        missing = sorted(set(range(self.num_processes)) - set(live))
        return describe_lost(missing, self.num_processes) if missing else None

    def lost_line(self, wait_s: float = HEARTBEAT_TIMEOUT_S + 2) -> str:
        """Which processes are gone, waiting up to `wait_s` for the coordination service to notice (a step fails at
        once when a peer's connection closes; its heartbeats take up to HEARTBEAT_TIMEOUT_S to be missed)."""
        deadline = time.monotonic() + wait_s
        while True:
            if (loss := self.loss()) is not None:
                return loss
            if time.monotonic() >= deadline:
                return "no process is reported lost, but the group's collectives failed"
            time.sleep(WATCH_INTERVAL_S)

    def stop(self) -> None:
        """A clean end of this process's part: wait (up to STOP_TIMEOUT_S) until every process reached its own, then
        disconnect this process's coordination client. The clients' disconnects meet at the service's shutdown
        barrier, which answers them all at once; process 0 then keeps its service up for STOP_GRACE_S, so that the
        others' answers reach them before its exit takes the service away. A client whose disconnect finds no service
        aborts its process: a follower ended with SIGABRT after its clean last line when it exited, or disconnected,
        while process 0 went. Raises when a process does not arrive: it is gone already, and nothing is left to tell
        it."""
        self.client.wait_at_barrier("jaxserve/stopped", STOP_TIMEOUT_S * 1000)
        self._leaving.set()  # the watches would ask a disconnected client
        for thread in self._watches:
            thread.join()
        self.client.shutdown()
        if self.leader:
            time.sleep(STOP_GRACE_S)

    def watch(
        self, on_lost: Callable[[str], None], busy_since: Callable[[], float | None], step_timeout_s: float
    ) -> threading.Thread:
        """A daemon thread that calls `on_lost(why)` once, when a process stops sending heartbeats, the coordination
        service cannot be reached, or a step has waited for the group longer than `step_timeout_s` (a process that
        hangs but still beats: `busy_since()` is when the step being waited for was, or None)."""

        def run() -> None:
            while not self._leaving.is_set():
                if (loss := self.loss()) is not None:
                    on_lost(loss)
                    return
                since = busy_since()
                if since is not None and time.monotonic() - since > step_timeout_s:
                    on_lost(
                        f"a step has waited {time.monotonic() - since:.0f} s for the group's other processes "
                        f"(--distributed-step-timeout {step_timeout_s:g}): one of them hangs"
                    )
                    return
                time.sleep(WATCH_INTERVAL_S)

        thread = threading.Thread(target=run, name="jaxserve-group-watch", daemon=True)
        self._watches.append(thread)
        thread.start()
        return thread


@dataclass(frozen=True)
class CompiledEverywhere:
    """The group's CompileSync (jaxserve.runner.mirror): every process but 0 sets a key in the coordination service
    when it has compiled a step shape, and process 0 waits for them before the shape's first run. Without it a
    process compiling a shape more than 30 s slower than process 0 (a colder compile cache, busier cores) failed the
    shape's first collective ("Gloo context initialization failed: DEADLINE_EXCEEDED")."""

    group: ProcessGroup
    timeout_s: float

    PREFIX = "jaxserve/compiled/"

    def compiled(self, key: str) -> None:
        if not self.group.leader:
            self.group.client.key_value_set(f"{self.PREFIX}{self.group.process_id}/{key}", "1")

    def wait_compiled(self, key: str) -> None:
        for process in range(1, self.group.num_processes):
            try:
                self.group.client.blocking_key_value_get(f"{self.PREFIX}{process}/{key}", int(self.timeout_s * 1000))
            except Exception as error:
                raise GroupLost(
                    f"process {process} did not compile step shape {key} within {self.timeout_s:g} s "
                    f"(--distributed-timeout): {error}"
                ) from error


def describe_lost(missing: list[int], num_processes: int) -> str:
    which = ", ".join(map(str, missing))
    return (
        f"lost process{'es' if len(missing) > 1 else ''} {which} of the group of {num_processes}: no heartbeat for "
        f"{HEARTBEAT_TIMEOUT_S} s (it died, hung, or its host is unreachable)"
    )


class CoordinationChannel:
    """Process 0's messages to the others through the coordination service's key-value store: message n under its
    own key, which each follower waits for in turn. A key is deleted once every follower must have read it (each
    message carries a forward, which process 0 cannot complete before every process ran it, and at most a few steps
    are in flight), so the store stays small."""

    PREFIX = "jaxserve/calls/"
    KEEP = 16  # messages kept behind the newest
    POLL_MS = 1000

    def __init__(self, client: Any):
        self.client = client
        self.sent = 0
        self.received = 0

    def send(self, payload: bytes) -> None:
        self.client.key_value_set_bytes(f"{self.PREFIX}{self.sent}", payload)
        if self.sent >= self.KEEP:
            self.client.key_value_delete(f"{self.PREFIX}{self.sent - self.KEEP}")
        self.sent += 1

    def receive(self) -> bytes | None:
        try:
            payload = self.client.blocking_key_value_get_bytes(f"{self.PREFIX}{self.received}", self.POLL_MS)
        except Exception as error:
            if "DEADLINE_EXCEEDED" in str(error) or "Deadline" in str(error):
                return None  # nothing yet: the caller asks again (and checks whether it should stop)
            raise GroupLost(f"the coordination service (process 0) cannot be reached: {error}") from error
        self.received += 1
        return bytes(payload)
