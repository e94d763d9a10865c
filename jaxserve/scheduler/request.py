"""Host-side request records and the two kinds of batch the scheduler hands to the runner."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 means off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        # Accept any iterable (e.g. a JSON list) but store a tuple, so the params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = {
            "max_tokens": (self.max_tokens >= 1, "must be >= 1"),
            "temperature": (self.temperature >= 0, "must be >= 0"),
            "top_p": (0 < self.top_p <= 1, "must be in (0, 1]"),
            "top_k": (self.top_k == -1 or self.top_k >= 1, "must be -1 (off) or >= 1"),
        }
        for name, (ok, rule) in checks.items():
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: {rule}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages or slot
    PREFILLING = "prefilling"  # admitted: pages and slot reserved, prompt partly in the KV cache
    RUNNING = "running"  # prompt done, in the decode manager
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: two requests are never "equal" because their fields match
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_prefilled: int = 0  # prompt tokens already scheduled into the KV cache
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt (there is no position to sample from)")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_len - self.num_prefilled

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled >= self.prompt_len

    @property
    def total_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def max_total_len(self) -> int:
        return self.prompt_len + self.sampling.max_tokens

    def mark_finished(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens `request.prompt_ids[start:start + length]`, at positions start, start + 1, ..."""

    request: Request
    start: int
    length: int

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_ids[self.start:self.start + self.length]

    @property
    def is_last(self) -> bool:
        # The token sampled after the last chunk is the request's first output token.
        return self.start + self.length == self.request.prompt_len


@dataclass(frozen=True)
class PrefillBatch:
    phase: ClassVar[str] = "prefill"
    chunks: list[PrefillChunk]

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def completed(self) -> list[Request]:
        """Requests whose prompt this batch completes, in batch order."""
        return [c.request for c in self.chunks if c.is_last]


@dataclass(frozen=True)
class DecodeBatch:
    phase: ClassVar[str] = "decode"
    requests: list[Request]
    # The policy that put this decode ahead of prefill ("interleave" or "stall"); None for the fallback decode
    # taken because no prefill batch could be formed. Prefill is not asked first, so it may have had nothing.
    forced_by: str | None = None

    @property
    def forced(self) -> bool:
        return self.forced_by is not None

    @property
    def num_tokens(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class MixedBatch:
    """A prefill step that also advances every running request by one token (`--mixed-batches`)."""

    phase: ClassVar[str] = "mixed"
    prefill: PrefillBatch
    decode: DecodeBatch

    @property
    def num_tokens(self) -> int:
        return self.prefill.num_tokens + self.decode.num_tokens

    @property
    def completed(self) -> list[Request]:
        return self.prefill.completed


Batch = PrefillBatch | DecodeBatch | MixedBatch
