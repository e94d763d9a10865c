"""The device side: the jitted steps over shape buckets (model_runner.py), sampling and logprobs on the device, the
memory plan (plan.py), the progress line of long start-up work, and several hosts: the process group (group.py) and
process 0's device calls replayed by the others (mirror.py)."""

from jaxserve.runner.model_runner import Buckets, CompileCounter, ModelRunner, build_runner, step_limits

__all__ = ["Buckets", "CompileCounter", "ModelRunner", "build_runner", "step_limits"]
