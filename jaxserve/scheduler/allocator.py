"""The one host-side allocator of numbered resources: KV pages (many per request) and slots (one per request)."""

from __future__ import annotations

import threading


class Exhausted(RuntimeError):
    """Not enough free ids for an all-or-nothing allocation; nothing was taken."""


class IdAllocator:
    """Hands out ids in [0, size) (fresh ones lowest first); allocation is all-or-nothing, freeing checks every id.

    Thread-safe, so gauges read from other threads see a consistent count."""

    def __init__(self, size: int, what: str):
        if size <= 0:
            raise ValueError(f"{what}: {size} in total; must be positive")
        self.size = size
        self.what = what  # named in every error ("KV pages", "slots")
        self._free = list(range(size - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} {self.what}")
        with self._lock:
            if n > len(self._free):
                raise Exhausted(f"asked for {n} {self.what} but only {len(self._free)} of {self.size} are free")
            ids = [self._free.pop() for _ in range(n)]
            self._used.update(ids)
            return ids

    def free(self, ids: list[int]) -> None:
        with self._lock:
            unknown = [i for i in ids if i not in self._used]
            if unknown or len(set(ids)) != len(ids):
                raise ValueError(f"freeing {self.what} that are not allocated (or twice): {sorted(unknown or ids)}")
            for i in ids:
                self._used.remove(i)
                self._free.append(i)
