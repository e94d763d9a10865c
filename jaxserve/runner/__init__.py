"""The device side: the jitted steps over shape buckets (model_runner.py), sampling and logprobs on the device, the
memory plan (plan.py) and the progress line of long start-up work."""

from jaxserve.runner.model_runner import Buckets, CompileCounter, ModelRunner, build_runner, step_limits

__all__ = ["Buckets", "CompileCounter", "ModelRunner", "build_runner", "step_limits"]
