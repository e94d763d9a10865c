"""Host-side scheduling: the prefill and decode managers, the page and slot allocator, the prefix cache (the KV
pages' owner), the step policies and the queue orders, the decision, and the one place flags become a
scheduler."""

from jaxserve.scheduler.allocator import Exhausted, IdAllocator
from jaxserve.scheduler.compose import build_scheduler
from jaxserve.scheduler.decode import DecodeManager
from jaxserve.scheduler.policies import DecodeInterleavePolicy, MixedSteps, step_policies
from jaxserve.scheduler.policy import PolicyContext, StepPolicy, register_step_policy
from jaxserve.scheduler.prefill import PrefillManager
from jaxserve.scheduler.prefix_cache import PrefixCache, PrefixStats
from jaxserve.scheduler.queue_order import FirstComeFirstServed, Priority, QueueOrder
from jaxserve.scheduler.scheduler import Scheduler, StepCounts
from jaxserve.scheduler.stall import DecodeStallPolicy

__all__ = [
    "DecodeInterleavePolicy",
    "DecodeManager",
    "DecodeStallPolicy",
    "Exhausted",
    "FirstComeFirstServed",
    "IdAllocator",
    "MixedSteps",
    "PolicyContext",
    "PrefillManager",
    "PrefixCache",
    "PrefixStats",
    "Priority",
    "QueueOrder",
    "Scheduler",
    "StepCounts",
    "StepPolicy",
    "build_scheduler",
    "register_step_policy",
    "step_policies",
]
