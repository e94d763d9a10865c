"""Host-side allocator of per-sequence cache rows ("slots"): one per admitted request."""

from __future__ import annotations


class SlotsExhausted(RuntimeError):
    pass


class SlotAllocator:
    """Hands out slot ids in [0, num_slots); used from the engine loop thread only."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots={num_slots}: must be positive")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise SlotsExhausted(f"all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"freeing slot {slot}, which is not allocated (or was freed twice)")
        self._used.remove(slot)
        self._free.append(slot)
