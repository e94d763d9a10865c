"""Start-up time: how soon `jaxserve serve` answers, how long compiling takes, and how it grows with the model's depth.

`cold_ready_s`, `warm_ready_s`, `cold_ready_mixed_s`: seconds from starting `jaxserve serve` (the embedded default,
the README's command) to its `jaxserve ready` line, with an empty compilation cache folder, with the folder the cold
run filled (the median of three such starts, their range beside it), and cold with `--mixed-batches`; `shapes`,
`shapes_mixed`: step shapes compiled in all (the rest after ready, while serving: `cold_all_compiled_s` is when the
last one was done). Goals: cold <= 30 s, mixed <= 45 s, warm <= 8 s.

`compile_s_4_layers`, `compile_s_43_layers`: seconds to trace, lower and compile one DeepSeek-V4-Flash decode step
(the `flash` preset, bf16, the runner's own step: forward, sampling, donated cache) on 8 fake CPU devices (mesh
tensor 2 x expert 4), for the first 4 layers of Flash's layer pattern and for all 43. The weights are abstract
(ShapeDtypeStructs carrying their shardings): nothing of the 43-layer model is allocated, only a small KV cache.
The persistent compilation cache is off, so every compile is cold. Goal: 43 layers cost at most 2.5x 4 layers
(the forward compiles one body per layer kind, not one per layer).

Results are merged into benchmarks/results/startup.json (keys this script does not measure are kept).

    .venv/bin/python benchmarks/startup.py [--only serve|compile]   # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, configure_jax, load_average, machine_info, markdown_table, median, timed, write_results

GOAL_DEPTH_RATIO = 2.5  # compile_s_43_layers / compile_s_4_layers
GOAL_READY_S = {"cold_ready_s": 30, "cold_ready_mixed_s": 45, "warm_ready_s": 8}
DEPTHS = (4, 43)
DECODE_ROWS = 4
WARM_STARTS = 3  # a warm start is short enough that one busy second moves it: the median of three is reported


def compile_decode_step(layers: int) -> float:
    """Seconds to trace, lower and compile the runner's decode step for Flash cut to its first `layers` layers."""
    import jax
    from common import geometry

    from jaxserve.model.sharding import make_mesh, shape_dtype_structs
    from jaxserve.model.weights import abstract_weights
    from jaxserve.presets import preset
    from jaxserve.request.step import GroupShape, StepShape
    from jaxserve.runner import Buckets, ModelRunner

    cfg = preset("flash", dtype="bfloat16", num_hidden_layers=layers)
    mesh = make_mesh(tensor_parallel_size=2, expert_parallel_size=4)
    weights = shape_dtype_structs(abstract_weights(cfg), mesh)
    geo = geometry(cfg, slots=DECODE_ROWS, max_tokens=1024)
    runner = ModelRunner(
        cfg, weights, geo, mesh, Buckets(prefill_rows=(1,), prefill_chunks=(16,), decode_rows=(DECODE_ROWS,))
    )
    shape = StepShape(decode=GroupShape(DECODE_ROWS, 1))
    jax.clear_caches()

    def compile_once():
        runner.compile(shape)  # the step's forward and its samplers

    return timed(compile_once)


def serve_until_ready(flags: list[str], cache: Path) -> dict[str, float]:
    """Start `jaxserve serve` (one CPU device, as on a newcomer's machine), read its output until every shape is
    compiled, then stop it; seconds from the start to `jaxserve ready` and to the last compile."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--compilation-cache-dir", str(cache), *flags]
    started = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    times = {}
    try:
        for line in process.stdout:
            if line.startswith("jaxserve ready"):
                times["ready_s"] = round(time.perf_counter() - started, 1)
            if line.startswith("compiled all "):
                times["all_compiled_s"] = round(time.perf_counter() - started, 1)
                break
            if "error" in line.lower() and "jaxserve" in line:
                raise RuntimeError(line.strip())
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    if "ready_s" not in times:
        raise RuntimeError(f"{' '.join(cmd)} never said it was ready")
    return times


def measure_serving() -> dict:
    from jaxserve.config import EngineConfig
    from jaxserve.runner import Buckets

    def shapes(mixed: bool) -> int:
        return len(Buckets.for_config(EngineConfig(mixed_batches=mixed)).shapes())

    load_at_start = load_average()
    with tempfile.TemporaryDirectory() as plain, tempfile.TemporaryDirectory() as mixed:
        cold = serve_until_ready([], Path(plain))
        print(f"cold start: ready after {cold['ready_s']} s, all compiled after {cold['all_compiled_s']} s", flush=True)
        warm = [serve_until_ready([], Path(plain))["ready_s"] for _ in range(WARM_STARTS)]
        print(f"warm starts: ready after {warm} s", flush=True)
        cold_mixed = serve_until_ready(["--mixed-batches"], Path(mixed))
        print(
            f"cold start, --mixed-batches: ready after {cold_mixed['ready_s']} s, all compiled after "
            f"{cold_mixed['all_compiled_s']} s",
            flush=True,
        )
    measured = {
        "cold_ready_s": cold["ready_s"],
        "warm_ready_s": median(warm),
        "warm_ready_range_s": [min(warm), max(warm)],
        "cold_ready_mixed_s": cold_mixed["ready_s"],
        "cold_all_compiled_s": cold["all_compiled_s"],
        "cold_all_compiled_mixed_s": cold_mixed["all_compiled_s"],
        "shapes": shapes(False),
        "shapes_mixed": shapes(True),
        "serve_load_average_1min_start_end": [load_at_start, load_average()],
    }
    measured["ready_goals_met"] = all(measured[k] <= goal for k, goal in GOAL_READY_S.items())
    return measured


def merge_results(name: str, measured: dict) -> dict:
    """The results file's current contents with `measured` written over them (other scripts' keys kept)."""
    path = RESULTS / f"{name}.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update(measured)
    rows = [[key, value] for key, value in merged.items() if not isinstance(value, dict)]
    write_results(name, merged, "# Start-up\n\n" + markdown_table(["measure", "value"], rows) + "\n")
    return merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1, help="compiles per depth (the median is reported)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    parser.add_argument(
        "--only", choices=("serve", "compile"), help="measure only the serve start-up or only the Flash compile"
    )
    args = parser.parse_args(argv)
    configure_jax(devices=8, compile_cache=False)
    if args.only != "compile":
        serving = measure_serving()
        if not args.no_write:
            merge_results("startup", serving)
        if args.only == "serve":
            return

    info = machine_info()
    seconds: dict[int, list[float]] = {n: [] for n in DEPTHS}
    for _ in range(args.repeats):
        for layers in DEPTHS:  # alternating, so load on the shared machine hits both alike
            seconds[layers].append(compile_decode_step(layers))
            print(f"flash decode step, {layers} layers: compiled in {seconds[layers][-1]:.1f} s", flush=True)
    compile_s = {n: round(median(s), 2) for n, s in seconds.items()}
    ratio = round(compile_s[43] / compile_s[4], 2)
    measured = {
        "compile_s_4_layers": compile_s[4],
        "compile_s_43_layers": compile_s[43],
        "compile_ratio_43_to_4_layers": ratio,
        "compile_goal_met": ratio <= GOAL_DEPTH_RATIO,
        "compile_setup": {
            "preset": "flash",
            "dtype": "bfloat16",
            "devices": 8,
            "mesh": "tensor 2 x expert 4",
            "step": f"decode, {DECODE_ROWS} rows",
            "weights": "abstract (ShapeDtypeStruct)",
            "repeats": args.repeats,
            **info,
            "load_average_1min_at_end": load_average(),
        },
    }
    verdict = "met" if ratio <= GOAL_DEPTH_RATIO else "NOT met"
    print(f"43 / 4 layers: {ratio:.2f}x (goal <= {GOAL_DEPTH_RATIO}x: {verdict})")
    if not args.no_write:
        merge_results("startup", measured)


if __name__ == "__main__":
    main()
