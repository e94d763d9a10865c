"""`jaxserve plan --target GPU`: every step shape of the buckets compiled for a GPU this machine does not have (JAX's
deviceless ahead-of-time compile, jaxserve.runner.targets), the Pallas kernels included; the report lists each
shape's temporaries and compile time and the largest decode step's static estimate against the least it must read.
A shape that fails to compile is an error naming the shape and the kernel; an unknown GPU is refused naming the
known ones."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import jaxserve.kernels
from jaxserve.checkpoints.load import model_config
from jaxserve.cli.main import main, print_target_steps
from jaxserve.config import EngineConfig, to_hf_dict
from jaxserve.kernels.quant import FP4, FP8
from jaxserve.model.sharding import make_mesh
from jaxserve.presets import preset
from jaxserve.runner import Buckets
from jaxserve.runner.executables import ExecutableCache
from jaxserve.runner.plan import (
    DecodeEstimate,
    Plan,
    StepCompile,
    StepCompileError,
    decode_read_bytes,
    kernel_scope,
    make_plan,
    usable_memory,
)
from jaxserve.runner.targets import TARGETS, target_devices

REPO = Path(__file__).resolve().parents[1]
# FP8 projections and FP4 experts (as tests/test_quantized_weights.py builds them): the block-scaled matmul and the
# grouped expert matmul compile as Pallas kernels for the GPU.
TINY = preset("tiny", dtype="bfloat16", hidden_size=160, moe_intermediate_size=64, head_dim=64, o_lora_rank=128)
QUANTIZED = TINY.__class__(**{**TINY.__dict__, "linear_format": FP8, "expert_format": FP4})
# Four step shapes (one prefill chunk, decodes of 1 and 2 rows, the mixed step): each deviceless compile takes
# ~10-20 s on 2 cores.
KNOBS = dict(max_num_seqs=2, chunked_prefill_size=16, max_prefill_rows=1, max_model_len=128, page_size=16)
FLAGS = [f"--{name.replace('_', '-')}={value}" for name, value in KNOBS.items()] + ["--mixed-batches"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint folder of the quantized tiny config alone: `plan` reads config.json, never the weights."""
    folder = tmp_path_factory.mktemp("tiny-fp8-fp4")
    (folder / "config.json").write_text(json.dumps(to_hf_dict(QUANTIZED)))
    return folder


def test_plan_compiles_every_step_shape_for_an_h200_and_estimates_the_largest_decode(checkpoint):
    # The command sets the CPU platform's compile-only devices and XLA's cost-model flag itself: no XLA_FLAGS here.
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    argv = ["plan", "--model", str(checkpoint), "--target", "h200", *FLAGS, "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "jaxserve", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    h200 = TARGETS["h200"]
    assert report["target"] == "h200" and report["fits"] and report["devices"] == 1
    assert report["device_memory"] == usable_memory(h200.memory_bytes)  # --device-memory defaults to the GPU's
    for kernel in ("grouped_matmul", "einsum", "sink_attention", "hc_pre"):
        assert f"{kernel} pallas" in report["kernels"]  # natively, through Triton: not "pallas (interpret)"
    assert report["kernels"].endswith("layers unrolled on one device")  # one GPU traces every layer in line

    shapes = [str(shape) for shape in Buckets.for_config(EngineConfig(**KNOBS, mixed_batches=True)).shapes()]
    assert len(shapes) == 4 and report["compiled_steps"] == shapes and "+ decode" in shapes[-1]
    steps = report["steps"]
    assert [step["shape"] for step in steps] == shapes
    assert all(step["temp_bytes"] > 0 and step["compile_s"] > 0 for step in steps)
    assert report["temp_bytes_per_device"] == max(step["temp_bytes"] for step in steps)

    estimate = report["decode_estimate"]
    assert estimate["shape"] == "decode rows=2 chunk=1" and (estimate["rows"], estimate["context"]) == (2, 128)
    assert estimate["launches"] > 0 and estimate["bytes"] > 0 and estimate["estimate_s"] > 0
    assert estimate["model_s"] > 0  # the cost model priced the fusions: the flag was set before JAX started
    # The bound: the weights one device holds, 4 of the 8 routed experts (2 rows x top-2), no embedding or hash
    # table, and 128 tokens of KV per row.
    cfg = model_config(str(checkpoint))
    bound = decode_read_bytes(cfg, make_mesh(1, 1, jax.devices()[:1]), 2, 128)
    assert estimate["bound_bytes"] == bound > 0
    assert estimate["bound_s"] == pytest.approx(bound / h200.bandwidth)
    assert decode_read_bytes(cfg, make_mesh(1, 1, jax.devices()[:1]), 1, 128) < bound


def test_the_text_report_has_a_row_per_shape_and_the_estimate_against_the_bound(capsys):
    plan = Plan(1, 10**11, 10**6, {}, 10**6, 3 * 10**6, 0, 56.0, 0, 128, 2, 2, True, "", 1.5, target="h200")
    plan.kernels = "einsum pallas"
    plan.steps = [StepCompile("prefill rows=1 chunk=16", 3 * 10**6, 1.0), StepCompile("decode rows=2 chunk=1", 10, 0.5)]
    plan.decode_estimate = DecodeEstimate("decode rows=2 chunk=1", 2, 128, 300, 2e6, 1e-5, 4e-5, 2 * 10**6, 2e-6)
    print_target_steps(plan, "h200")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step temporaries per device: 0.00 GB, the largest of 2 step shapes compiled for h200")
    assert out[1].split() == [
        "prefill",
        "rows=1",
        "chunk=16",
        "temporaries",
        "3.00",
        "MB",
        "compiled",
        "in",
        "1.0",
        "s",
    ]
    assert "300 kernel launches" in out[3] and "0.04 ms" in out[3] and "0.002 ms" in out[3]
    assert out[3].endswith("20.0x the bound")


def test_an_unknown_target_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["plan", "--preset", "tiny", "--target", "nosuch"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "jaxserve plan: error: argument --target: invalid choice: 'nosuch' (choose from " in err
    assert all(name in err.split("choose from ")[1] for name in ("h200", "h100", "b200"))
    with pytest.raises(ValueError, match="--target 'nosuch': must be one of h200, h100, b200"):
        make_plan(TINY, EngineConfig(**KNOBS), make_mesh(1, 1, jax.devices()[:1]), 10**9, target="nosuch")


def _raise_in_a_kernel(message: str) -> None:
    """Raise `message` from a frame in jaxserve's Pallas kernels, as a kernel's lowering does (JAX attaches the
    trace of the operation that failed as the cause)."""
    source = "def kernel(message):\n    raise ValueError(message)\n"
    namespace: dict = {}
    exec(
        compile(source, str(Path(jaxserve.kernels.__file__).parent / "pallas" / "grouped_matmul.py"), "exec"), namespace
    )
    try:
        namespace["kernel"](message)
    except ValueError as traced:
        raise NotImplementedError(message) from traced


def test_a_step_that_fails_to_compile_is_an_error_naming_the_shape_and_the_kernel(capsys, monkeypatch):
    message = "The Pallas Triton lowering currently requires that all operations have array arguments ... of 2"

    def fails(self, shape):
        _raise_in_a_kernel(message)

    monkeypatch.setattr(ExecutableCache, "_compile", fails)
    with pytest.raises(StepCompileError) as failed:
        make_plan(QUANTIZED, EngineConfig(**KNOBS), make_mesh(1, 1, target_devices("h200", 1)), 10**11, "h200")
    assert str(failed.value) == (
        "compiling step prefill rows=1 chunk=16 for NVIDIA H200 141GB HBM3e failed in "
        f"kernels/pallas/grouped_matmul.py:2 (kernel): NotImplementedError: {message}"
    )
    # Through the command: one line, exit status 1 (the environment is the tests' own: CPU platform, the flag set).
    monkeypatch.setattr(importlib.import_module("jaxserve.cli.main"), "prepare_for_target", lambda: None)
    assert main(["plan", "--preset", "tiny", "--target", "h200", *FLAGS]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jaxserve plan: error: compiling step prefill rows=1 chunk=16 for NVIDIA H200")
    assert "in kernels/pallas/grouped_matmul.py:2 (kernel)" in err
    # An XLA message quoting the instruction names its scope instead.
    xla = RuntimeError('INTERNAL: ptxas exited: %fusion.3 = f32[4] fusion(), metadata={op_name="jit(f)/moe/route"}')
    assert kernel_scope(xla) == "jit(f)/moe/route"
