"""The HTTP face's knobs (`jaxserve serve` only), one field per CLI flag; the engine's are jaxserve.config's
EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.config import ConfigError, flag

DEFAULT_SERVED_NAME = "jaxserve-default"

# A 16K-token prompt is ~100 KB as text and ~120 KB as a JSON list of ids; 4 MiB leaves room for a million-token
# text prompt while refusing the runaway bodies that would pin a worker tokenizing them.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    """One field per CLI flag of `jaxserve serve`, declared in its metadata (jaxserve.config.flag)."""

    served_model_name: str | None = field(
        default=None,
        metadata=flag(
            str,
            f"the model name clients use (default: {DEFAULT_SERVED_NAME}, or the --model folder's name)",
            metavar="NAME",
        ),
    )
    log_stats_interval: float = field(
        default=5.0, metadata=flag(float, "seconds between throughput lines while busy; <= 0: never")
    )
    host: str = field(default="127.0.0.1", metadata=flag(str, "address to listen on", metavar="HOST"))
    port: int = field(default=8000, metadata=flag(int, "port to listen on (0: any free port)"))
    api_key: str | None = field(
        default=None,
        metadata=flag(
            str,
            "require `Authorization: Bearer KEY` on /v1/*, /invocations and the tokenizer routes (/health, /ping, "
            "/version and /metrics stay open)",
            metavar="KEY",
        ),
    )
    shutdown_timeout: float = field(
        default=30.0, metadata=flag(float, "seconds running requests get to finish after SIGTERM")
    )
    max_request_bytes: int = field(
        default=DEFAULT_MAX_REQUEST_BYTES,
        metadata=flag(int, "larger request bodies are refused with HTTP 413, unread", metavar="BYTES"),
    )
    access_log: bool = field(
        default=True,
        metadata=flag(
            bool, "log one line per request (client, method, path, status, prompt and completion tokens, seconds)"
        ),
    )

    def __post_init__(self):
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"host={self.host!r}: must be a non-empty address")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port!r}: must be an integer in [0, 65535]")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("served_model_name='': must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key='': an empty key would let anyone in; leave --api-key out for an open server")
        if not self.shutdown_timeout >= 0:
            raise ConfigError(f"shutdown_timeout={self.shutdown_timeout!r}: must be >= 0")
        if (
            not isinstance(self.max_request_bytes, int)
            or isinstance(self.max_request_bytes, bool)
            or self.max_request_bytes <= 0
        ):
            raise ConfigError(f"max_request_bytes={self.max_request_bytes!r}: must be a positive integer")
