"""Multi-controller serving: process 0's device calls, replayed in the same order by every other process.

Under JAX's multi-controller runtime every process runs the same compiled steps on the global mesh, each feeding the
devices it owns, and a step's collectives pair the processes' calls in the order they are made. Only process 0
schedules, so before each forward it sends the calls it made since the last one (`Call`s: a forward with its host
inputs, a sampler launch with its sampling arrays, a cache reset), and every other process (a `Follower`) replays
them on its own `ModelRunner`. The sampled tokens come out replicated over the mesh, so process 0 reads them from its
own devices: nothing travels back.

Calls without collectives (the sampler, a cache reset) wait in process 0's log and go with the next forward, which
they precede: one message a step. What carries the messages is a `Channel` (`jaxserve.runner.group`: the
coordination service's key-value store).
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from jaxserve.request.step import StepShape

log = logging.getLogger("jaxserve.runner")


@dataclass(frozen=True)
class ForwardCall:
    """A forward of the compiled step `shape` on these host inputs; `number` counts forwards from 0 in both
    processes, so the sampler call that follows can name whose logits it samples."""

    number: int
    shape: StepShape
    groups: Any  # tuple of GroupInputs of host arrays, one per group (drafting None: never in a group)


@dataclass(frozen=True)
class SampleCall:
    """The sampler launch after forward `number`: per group its sampling arrays (`allowed` None where the group
    allows every token: each process keeps that mask on its devices) and its penalties (None: none)."""

    number: int
    samplings: Any  # tuple of SamplingArrays of host arrays
    penalties: Any  # tuple of PenaltyArrays | None


@dataclass(frozen=True)
class ResetCall:
    """The cache rebuilt (after a failed call consumed it)."""


@dataclass(frozen=True)
class StopCall:
    """Process 0 is shutting down cleanly: the followers stop replaying and exit 0."""


Call = ForwardCall | SampleCall | ResetCall | StopCall


class Channel(Protocol):
    """Ordered messages from process 0 to every other process."""

    def send(self, payload: bytes) -> None: ...

    def receive(self) -> bytes | None:
        """The next message; None if none came within the channel's poll interval (ask again)."""


@dataclass
class CallLog:
    """Process 0's side: the calls made since the last message, sent with the next forward (or `stop`)."""

    channel: Channel
    pending: list[Call] = field(default_factory=list)
    send_seconds: list[float] = field(default_factory=list)  # each message's send, for the benchmark
    sent_bytes: int = 0

    def add(self, call: Call) -> None:
        """Called under the runner's launch lock, right before the call runs, so the log has the launch order."""
        self.pending.append(call)
        if isinstance(call, ForwardCall | StopCall):
            self._flush()

    def stop(self) -> None:
        self.add(StopCall())

    def _flush(self) -> None:
        started = time.perf_counter()
        payload = pickle.dumps(self.pending, protocol=pickle.HIGHEST_PROTOCOL)
        self.channel.send(payload)
        self.send_seconds.append(time.perf_counter() - started)
        self.sent_bytes += len(payload)
        self.pending = []


class CompileSync(Protocol):
    """A step shape's first run is its first collectives, and the other processes must reach them in time (jax's
    CPU collectives give a peer 30 s): process 0 runs a shape only once every process has compiled it."""

    def compiled(self, key: str) -> None:
        """This process has compiled the shape named `key` (said by every process but 0)."""

    def wait_compiled(self, key: str) -> None:
        """Return once every other process has compiled it (process 0, before the shape's first run)."""


class Replayer(Protocol):
    """What a follower replays calls on (jaxserve.runner.ModelRunner)."""

    def replay(self, call: Call) -> None: ...


class Follower:
    """Another process's side: receive process 0's calls and replay each on `runner`, until a StopCall."""

    def __init__(self, runner: Replayer, channel: Channel, stopped: Callable[[], bool] = lambda: False):
        self.runner, self.channel, self.stopped = runner, channel, stopped
        self.replayed = 0

    def run(self) -> None:
        """Replay until process 0 stops cleanly (returns) or the channel fails (raises); `stopped()` is asked while
        no message comes."""
        while not self.stopped():
            payload = self.channel.receive()
            if payload is None:
                continue
            calls: list[Call] = pickle.loads(payload)  # process 0's own pickles, over the group's private channel
            for call in calls:
                if isinstance(call, StopCall):
                    log.info("process 0 stopped; %d calls replayed", self.replayed)
                    return
                self.runner.replay(call)
                self.replayed += 1
