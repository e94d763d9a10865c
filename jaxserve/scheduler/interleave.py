"""`--decode-interleave-every N`: after N consecutive prefill steps, take one decode step if one is runnable.

A pure counter (no engine, no device), semantics as in docs/scheduling.md. The scheduler reports every
step it actually schedules; the policy only answers "is a decode due?".
"""

from __future__ import annotations


class DecodeInterleavePolicy:
    def __init__(self, every: int | None):
        self.every = every
        self._streak = 0  # prefill steps scheduled since the last decode step

    @property
    def enabled(self) -> bool:
        return self.every is not None and self.every > 0

    @property
    def streak(self) -> int:
        return self._streak

    def note_prefill(self) -> None:
        # Only scheduled prefill steps count: idle steps earn no credit. While a due decode has no runnable
        # request the streak keeps growing past `every`, which is what latches the "due" state.
        if self.enabled:
            self._streak += 1

    def note_decode(self) -> None:
        self._streak = 0

    def wants_decode(self) -> bool:
        return self.enabled and self._streak >= self.every

    def reset(self) -> None:
        self._streak = 0
