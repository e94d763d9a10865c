"""`--scheduling-policy`: the order in which waiting requests are admitted (docs/scheduling.md).

A queue order gives each waiting request a sort key; ties go to the earlier arrival. It orders waiting requests
only: an admitted request is never preempted.
"""

from __future__ import annotations

from jaxserve.config import SCHEDULING_POLICIES
from jaxserve.request import InvalidRequest, Request


class QueueOrder:
    """The interface: a sort key per waiting request, and whether a request's `priority` means anything."""

    def key(self, request: Request) -> tuple[int, ...]:
        return ()  # arrival order decides

    def check_priority(self, priority: int) -> None:
        raise NotImplementedError


@SCHEDULING_POLICIES.register("fcfs")
class FirstComeFirstServed(QueueOrder):
    def check_priority(self, priority: int) -> None:
        """A request's priority is a 400 unless this order uses it: a field that silently did nothing would
        mislead."""
        if priority != 0:
            raise InvalidRequest(
                "priority",
                f"priority: {priority} asks for priority scheduling, which needs "
                "--scheduling-policy priority (this server schedules first come, first "
                "served)",
            )


@SCHEDULING_POLICIES.register("priority")
class Priority(QueueOrder):
    """vLLM's priority scheduling: a lower `priority` is admitted first; first come, first served among equals."""

    def key(self, request: Request) -> tuple[int, ...]:
        return (request.priority,)

    def check_priority(self, priority: int) -> None:
        """Any integer is a priority."""
