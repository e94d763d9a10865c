"""benchmarks/gpu_roofline.py's CPU dry run (--cpu-smoke): the script runs end to end on tiny shapes and writes a
report whose bounds follow from the bytes and FLOPs it counted. Its timings mean nothing on CPU, so only their
signs are checked, never a fraction of a bound. Its GPU trace parsing, which no CPU run reaches, is checked on a
trace laid out as jax.profiler writes one on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_roofline.py"
sys.path.insert(0, str(SCRIPT.parent))  # the script and its `common` helpers

import gpu_roofline  # noqa: E402

KINDS = ("swa_hash", "csa_hash", "hca")  # the Flash plan's first four layers: SWA x 2 and CSA hash-routed, HCA
FIELDS = (
    "device",
    "decode",
    "prefill_fraction_of_peak",
    "tiny_decode_period_s",
    "profile",
    "command_buffers",
    "bytes_counted",
    "kernels",
    "commands",
)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("roofline")
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # XLA_FLAGS as this session has them
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_roofline_cpu_smoke.json").read_text()), out


@pytest.mark.slow  # the script's run (shared): about two minutes on 2 cores
def test_report_has_every_field_for_every_batch_and_implementation(smoke):
    report, _ = smoke
    assert all(field in report for field in FIELDS)
    assert report["complete"] and report["errors"] == {}
    assert report["device"]["platform"] == "cpu" and report["device"]["device_kind"]
    assert set(report["kernels"]) == {"reference", "pallas"} and "pallas (interpret)" in report["kernels"]["pallas"]
    assert "--cpu-smoke" in report["commands"]["run"]
    batches = report["settings"]["batches"]
    for choice in report["kernels"]:
        for batch in batches:
            parts = {r["part"]: r for r in report["decode"] if r["implementation"] == choice and r["batch"] == batch}
            assert set(parts) == {"layer_step", *KINDS, "outside_layers"}, (choice, batch)
            assert parts["layer_step"]["step_s"] > 0 and parts["layer_step"]["latency_s"] > 0
            assert sum(parts[kind]["layers"] for kind in KINDS) == report["settings"]["layers"]
        assert report["prefill_fraction_of_peak"][choice] > 0


@pytest.mark.slow  # the script's run (shared): about two minutes on 2 cores
def test_bounds_are_the_counted_bytes_and_flops_over_the_peaks(smoke):
    report, _ = smoke
    bandwidth, peak = report["settings"]["bandwidth"], report["settings"]["peak_bf16"]
    assert report["bytes_counted"]["bandwidth"] == bandwidth
    for row in report["decode"]:
        assert row["bytes"] > 0 and row["bound_s"] == pytest.approx(row["bytes"] / bandwidth, rel=1e-12)
        if row["part"] == "layer_step":
            counted = report["bytes_counted"]["per_batch"][str(row["batch"])]
            assert row["bytes"] == pytest.approx(sum(counted.values()), rel=1e-12)
            assert row["fraction_of_bound"] == pytest.approx(row["bound_s"] / row["step_s"], rel=1e-12)
        else:  # a part's share of the step is never negative, and its bytes are part of the step's
            assert row["step_s"] >= 0 and row["kernel_s"] >= 0
    for batch, counted in report["bytes_counted"]["per_batch"].items():
        assert all(value >= 0 for value in counted.values()) and counted["routed_experts"] > 0
        steps = [r for r in report["decode"] if r["batch"] == int(batch)]
        layer_step = next(r for r in steps if r["part"] == "layer_step")
        per_part = sum(
            r["bytes"] * r["layers"]
            for r in steps
            if r["implementation"] == layer_step["implementation"] and r["part"] != "layer_step"
        )
        assert per_part == pytest.approx(layer_step["bytes"], rel=1e-12)  # the parts' bytes add up to the step's
    for prefill in report["prefill"]:
        flops = prefill["flops"]
        assert flops["total"] == pytest.approx(flops["matmuls"] + flops["head"] + flops["attention"], rel=1e-12)
        assert prefill["bound_s"] == pytest.approx(flops["total"] / peak, rel=1e-12)
        assert prefill["fraction_of_peak"] == pytest.approx(prefill["bound_s"] / prefill["step_s"], rel=1e-12)


@pytest.mark.slow  # the script's run (shared): about two minutes on 2 cores
def test_tiny_period_profile_and_command_buffers(smoke):
    report, _ = smoke
    tiny = report["tiny_decode"]
    assert report["tiny_decode_period_s"] == tiny["period_s"] > 0
    assert tiny["device_s"] > 0 and tiny["host_s"] == pytest.approx(tiny["period_s"] - tiny["device_s"])
    for choice, profile in report["profile"].items():
        assert "error" not in profile, (choice, profile)
        assert profile["kernel_count_per_step"] > 0 and 0 < len(profile["top_kernels"]) <= 10
        assert all(0 < k["share"] <= 1 for k in profile["top_kernels"])
        assert profile["d2h_copies_per_step"] is None  # XLA:CPU: no device copies to count
    assert report["command_buffers"] == "skipped: not a GPU"


@pytest.mark.slow  # the script's run (shared): about two minutes on 2 cores
def test_markdown_names_the_device_and_tabulates_the_figures(smoke):
    report, out = smoke
    text = (out / "gpu_roofline_cpu_smoke.md").read_text()
    assert report["device"]["device_kind"] in text.splitlines()[0]
    for heading in (
        "Decode step against the HBM bound",
        "Prefill chunk",
        "Tiny default model",
        "Profile of the",
        "command buffers",
        "How the bounds are counted",
    ):
        assert heading in text
    assert text.count("| layer_step |") == len(report["settings"]["batches"]) * len(report["kernels"])


GPU_HLO = """HloModule jit__step_fn, is_scheduled=true

%fused_computation.3 (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %add.1 = f32[8]{0} add(%param_0, %param_0), metadata={op_name="jit(_step_fn)/segment_1/csa_hash/attention/add"}
}

ENTRY %main.9 (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %dynamic-slice.2 = f32[8]{0} dynamic-slice(%p), metadata={op_name="jit(_step_fn)/segment_1/while/body/slice"}
  %loop_add_fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation.3
  ROOT %custom-call.5 = f32[8]{0} custom-call(%loop_add_fusion.3), custom_call_target="__cublas$gemm", \
metadata={op_name="jit(_step_fn)/dot_general"}
}
"""


def _event(tid, name, ts, dur, **args):
    return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def gpu_trace(steps: int) -> dict:
    """Steps of three kernels (one named after its fusion, two naming their HLO op), an input copy and a token copy
    back, on a GPU's stream lines; a kernel again on the derived "XLA Ops" line, which must not count."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0 NVIDIA H200"}},
        {"ph": "M", "pid": 1, "tid": 13, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 14, "name": "thread_name", "args": {"name": "Stream #14(MemcpyD2H)"}},
        {"ph": "M", "pid": 1, "tid": 200, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 700, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    events = []
    for step in range(steps):
        t = 1000.0 * step
        events += [
            _event(14, "MemcpyH2D", t, 2.0),
            _event(13, "dynamic_slice", t + 2, 3.0, hlo_op="dynamic-slice.2"),
            _event(13, "loop_add_fusion_3", t + 5, 30.0),
            _event(13, "sm90_xmma_gemm_bf16", t + 35, 10.0, hlo_op="custom-call.5", hlo_module="jit__step_fn"),
            _event(200, "custom-call.5", t + 35, 10.0),
            _event(14, "MemcpyD2H", t + 50, 1.0),
            {"ph": "X", "pid": 700, "tid": 1, "name": "PjitFunction(_step_fn)", "ts": t, "dur": 60.0},
        ]
    return {"traceEvents": meta + events}


def test_gpu_trace_parsing_counts_stream_kernels_and_copies():
    segments = {"segment_1": "csa_hash"}  # a segment of CSA layers: its scan's own ops are theirs
    summary = gpu_roofline.summarize_trace(gpu_trace(3), GPU_HLO, steps=3, on_cpu=False, segments=segments)
    assert summary["source"].startswith("device kernels")
    assert summary["kernel_count_per_step"] == 3
    assert summary["kernel_seconds_per_step"] == pytest.approx(43e-6)
    assert summary["d2h_copies_per_step"] == 1 and summary["copies_per_step"] == {"MemcpyH2D": 1, "MemcpyD2H": 1}
    top = {k["name"]: k for k in summary["top_kernels"]}
    assert top["loop_add_fusion_3"]["share"] == pytest.approx(30 / 43)
    assert top["loop_add_fusion_3"]["scope"] == "segment_1/csa_hash/attention/add"  # through its fused computation
    assert summary["part_seconds_per_step"] == pytest.approx({"csa_hash": 33e-6, "outside_layers": 10e-6})
    unplaced = gpu_roofline.summarize_trace(gpu_trace(1), GPU_HLO, steps=1, on_cpu=False)["part_seconds_per_step"]
    assert unplaced["unattributed"] == pytest.approx(3e-6)  # a segment of several kinds: its scan's ops stay unplaced


def test_a_trace_that_cannot_be_read_is_a_reason_not_a_crash(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trace JSON"):
        gpu_roofline.load_trace(str(tmp_path))
    with pytest.raises(ValueError, match="no kernels"):
        gpu_roofline.summarize_trace({"traceEvents": []}, GPU_HLO, steps=1, on_cpu=True)
    host_only = {"traceEvents": [e for e in gpu_trace(1)["traceEvents"] if e["pid"] != 1]}
    with pytest.raises(ValueError, match="no device lines"):  # a GPU trace without CUPTI's device lines
        gpu_roofline.summarize_trace(host_only, GPU_HLO, steps=1, on_cpu=False)
