"""Host-side scheduling: the prefill and decode managers, the page and slot allocator, the policies, the decision."""

from jaxserve.scheduler.allocator import Exhausted, IdAllocator
from jaxserve.scheduler.decode import DecodeManager
from jaxserve.scheduler.interleave import DecodeInterleavePolicy
from jaxserve.scheduler.prefill import PrefillManager
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.scheduler.stall import DecodeStallPolicy

__all__ = ["DecodeInterleavePolicy", "DecodeManager", "DecodeStallPolicy", "Exhausted", "IdAllocator",
           "PrefillManager", "Scheduler"]
