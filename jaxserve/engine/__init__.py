"""The engine: on its own thread, admission and the loop schedule -> run -> deliver -> finish; request handles, token
events and the stats snapshot (loop.py)."""

from jaxserve.engine.loop import (
    Engine,
    EngineDraining,
    EngineStats,
    QueueFull,
    RequestHandle,
    StepRecord,
    StepRunner,
    TokenEvent,
)

__all__ = [
    "Engine",
    "EngineDraining",
    "EngineStats",
    "QueueFull",
    "RequestHandle",
    "StepRecord",
    "StepRunner",
    "TokenEvent",
]
