"""GroupConfig: the process group of multi-controller serving."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.config.flags import ConfigError, flag


@dataclass(frozen=True)
class GroupConfig:
    """The process group of multi-controller serving (`serve` only): one process per host, all running process 0's
    steps on one global mesh (jaxserve.runner.group). Without these flags a launcher's environment that
    jax.distributed reads (Slurm's srun, Open MPI's mpirun, Kubernetes) still makes a group."""

    num_processes: int | None = field(
        default=None,
        metadata=flag(
            int,
            "processes in the group, usually one per host (default: 1, or what a launcher's environment says); their "
            "devices make one mesh for --tensor-parallel-size x --expert-parallel-size",
        ),
    )
    process_id: int | None = field(
        default=None,
        metadata=flag(
            int,
            "this process's rank in [0, --num-processes): process 0 answers HTTP, tokenizes and schedules; the others "
            "run its steps on their own devices and answer nothing",
        ),
    )
    coordinator_address: str | None = field(
        default=None,
        metadata=flag(
            str,
            "HOST:PORT where process 0 runs the group's coordination service (the same for every process)",
            metavar="HOST:PORT",
        ),
    )
    distributed_timeout: float = field(
        default=300.0,
        metadata=flag(
            float,
            "seconds a process waits at start-up for the whole group to join, and process 0 for every process to "
            "compile a step shape before its first run, before it exits with an error",
        ),
    )
    distributed_step_timeout: float = field(
        default=300.0,
        metadata=flag(
            float,
            "seconds process 0 waits for one step before it takes a process to hang and stops the group (a process "
            "that dies is found within 10 s by its missing heartbeats)",
        ),
    )

    def __post_init__(self):
        n = self.num_processes
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ConfigError(f"num_processes={n!r}: must be a positive integer")
        if n is not None and n > 1:
            if self.process_id is None or self.coordinator_address is None:
                raise ConfigError(
                    f"num_processes={n}: give every process --process-id (0 .. {n - 1}) and the same "
                    "--coordinator-address HOST:PORT"
                )
            if not 0 <= self.process_id < n:
                raise ConfigError(f"process_id={self.process_id}: must be in [0, {n}) for num_processes={n}")
            host, _, port = self.coordinator_address.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"coordinator_address={self.coordinator_address!r}: must be HOST:PORT")
        elif self.process_id not in (None, 0) or (n is None and self.coordinator_address is not None):
            raise ConfigError("--process-id and --coordinator-address need --num-processes")
        for name in ("distributed_timeout", "distributed_step_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)!r}: must be positive")
