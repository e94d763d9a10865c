"""Host-side scheduling: request records, the prefill and decode managers, the interleave policy, the decision."""

from jaxserve.scheduler.decode import DecodeManager
from jaxserve.scheduler.interleave import DecodeInterleavePolicy
from jaxserve.scheduler.prefill import PrefillManager
from jaxserve.scheduler.request import (Batch, DecodeBatch, MixedBatch, PrefillBatch, PrefillChunk, Request,
                                        RequestStatus, SamplingParams)
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.scheduler.stall import DecodeStallPolicy
from jaxserve.scheduler.slots import SlotAllocator, SlotsExhausted

__all__ = ["Batch", "DecodeBatch", "DecodeInterleavePolicy", "DecodeManager", "DecodeStallPolicy", "MixedBatch",
           "PrefillBatch", "PrefillChunk", "PrefillManager", "Request", "RequestStatus", "SamplingParams", "Scheduler",
           "SlotAllocator", "SlotsExhausted"]
