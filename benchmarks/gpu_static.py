"""A static roofline of DeepSeek-V4-Flash's layers on an H200, compiled here without a GPU (JAX's deviceless AOT).

    .venv/bin/python benchmarks/gpu_static.py              # about 4 minutes on 2 cores
    .venv/bin/python benchmarks/gpu_static.py --kernels pallas --batches 8 --no-prefill --hlo-dir /tmp/hlo

Each step is compiled for `--target` (default h200) by the engine's own runner (`AbstractRunner.compile_stages`,
abstract weights and cache on a deviceless mesh: jaxserve.runner.targets), with XLA's cost-model statistics on, and
read back from the optimized HLO by `jaxserve.runner.hlo_profile.static_profile`: the step's forward and the sampler
it runs (the one without the top-k / top-p sort); `temp_bytes` is the forward's. Per implementation (`--kernels`)
and step (decode at each of `--batches`, every row at position `--context`, and one prefill chunk of `--chunk`
tokens ending there):
kernel launches per step (loop trips multiplied) and per layer, bytes moved, XLA's cost-model time of the kernels it
prices (the "sol" model), Pallas calls' bytes, and the estimate (priced kernels' model time + every other kernel's
bytes / bandwidth) against the bound: for decode the HBM bound of the bytes the step must read
(`gpu_roofline.decode_bytes`), for prefill the bf16 compute bound of its FLOPs (`gpu_roofline.prefill_flops`).
These are model figures, not measurements: no kernel ran, autotuning is off in this mode (tilings can differ from a
real compile), and launch overheads are not in the estimate (the launch count says what they could cost).

Model: the first --layers layers of `preset("flash")` as `benchmarks/gpu_roofline.py` builds them (FP8 projections,
FP4 routed experts, `kv_cache_dtype="fp8"`, TP 1). Writes gpu_static.json and gpu_static.md under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
from common import markdown_table
from gpu_roofline import decode_bytes, layer_costs, prefill_flops

from jaxserve.config import EngineConfig
from jaxserve.model.cache import kv_geometry
from jaxserve.model.sharding import for_mesh, make_mesh, shape_dtype_structs
from jaxserve.model.weights import abstract_weights
from jaxserve.presets import preset
from jaxserve.request.step import GroupShape, StepShape
from jaxserve.runner import Buckets
from jaxserve.runner.hlo_profile import StaticProfile, step_profile
from jaxserve.runner.plan import AbstractRunner, prepare_for_target
from jaxserve.runner.targets import persistent_cache_off, target, target_devices

RESULTS = Path(__file__).resolve().parent / "results"
TOP_KERNELS = 10


def summary(profile: StaticProfile, bandwidth: float, layers: int, bound_s: float) -> dict:
    estimate = profile.estimate(bandwidth)
    return {
        "launches": profile.launches,
        "launches_per_layer": profile.launches / layers,
        "bytes": profile.bytes,
        "model_s": profile.model_seconds(),
        "pallas_bytes": profile.pallas_bytes(),
        "estimate_s": estimate,
        "bound_s": bound_s,
        "estimate_over_bound": estimate / bound_s,
        "costliest": [
            {
                "scope": k.scope,
                "kind": k.kind,
                "launches": k.launches,
                "bytes_per_launch": k.bytes,
                "seconds": k.seconds(bandwidth),
            }
            for k in profile.costliest(bandwidth, TOP_KERNELS)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="h200")
    parser.add_argument("--kernels", default="reference,pallas", help="comma list of --kernels choices")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--hlo-dir", type=Path, help="also write each step's optimized HLO there")
    args = parser.parse_args(argv)
    prepare_for_target()  # before JAX starts a backend: the CPU platform, XLA's cost-model statistics
    gpu = target(args.target)
    batches = tuple(int(b) for b in args.batches.split(","))
    mesh = make_mesh(1, 1, target_devices(args.target, 1))
    cfg = for_mesh(preset("flash", dtype="bfloat16", num_hidden_layers=args.layers), mesh)
    page_size = EngineConfig().page_size
    engine = EngineConfig(
        max_num_seqs=max(batches),
        max_model_len=args.context + page_size,
        page_size=page_size,
        kv_cache_dtype="fp8",
        chunked_prefill_size=args.chunk,
        max_prefill_rows=1,
    )
    geometry = kv_geometry(engine, cfg)
    costs = layer_costs(cfg, geometry)
    shapes = [(f"decode b={b}", StepShape(decode=GroupShape(b, 1))) for b in batches]
    if not args.no_prefill:
        shapes.append((f"prefill {args.chunk}", StepShape(prefill=GroupShape(1, args.chunk))))
    rows: list[dict] = []
    started = time.perf_counter()
    for choice in args.kernels.split(","):
        runner = AbstractRunner(
            cfg, shape_dtype_structs(abstract_weights(cfg), mesh), geometry, mesh, Buckets.for_config(engine), choice
        )
        for name, shape in shapes:
            t0 = time.perf_counter()
            with persistent_cache_off():
                # The forward and the sampler a step of this shape runs (the one that does not sort: no top-k/top-p).
                executables = [variants[0] for variants in runner.compile_stages(shape, gpu.name)]
            compile_s = time.perf_counter() - t0
            profile = step_profile(executables)
            if args.hlo_dir is not None:
                args.hlo_dir.mkdir(parents=True, exist_ok=True)
                for number, compiled in enumerate(executables):
                    stem = f"{choice}_{name.replace(' ', '_').replace('=', '')}_{number}"
                    (args.hlo_dir / f"{stem}.hlo").write_text(compiled.as_text())
            compiled = executables[0]
            if shape.decode is not None:
                bound = sum(decode_bytes(costs, cfg, shape.decode.rows, args.context).values()) / gpu.bandwidth
            else:
                flops = prefill_flops(costs, cfg, args.context - args.chunk, args.chunk)["total"]
                bound = flops / gpu.peak_bf16_flops
            row = {"kernels": choice, "step": name, "compile_s": compile_s}
            row.update(summary(profile, gpu.bandwidth, args.layers, bound))
            memory = compiled.memory_analysis()
            row["temp_bytes"] = int(memory.temp_size_in_bytes) if memory is not None else None
            rows.append(row)
            print(
                f"[{time.perf_counter() - started:6.0f} s] {choice:9s} {name:14s} launches {row['launches']:6d} "
                f"({row['launches_per_layer']:.0f}/layer)  estimate {row['estimate_s'] * 1e3:8.3f} ms  bound "
                f"{bound * 1e3:.3f} ms  ({row['estimate_over_bound']:.2f}x)",
                flush=True,
            )
    result = {
        "what": "static model figures from a deviceless compile, not measurements",
        "target": args.target,
        "bandwidth": gpu.bandwidth,
        "peak_bf16_flops": gpu.peak_bf16_flops,
        "layers": args.layers,
        "context": args.context,
        "jax": jax.__version__,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_static.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "gpu_static.md").write_text(markdown(result))
    return 0


def markdown(result: dict) -> str:
    head = ["kernels", "step", "launches", "per layer", "bytes (MB)", "XLA model (ms)", "Pallas bytes (MB)",
            "estimate (ms)", "bound (ms)", "estimate / bound"]  # fmt: skip
    table = [
        [
            r["kernels"], r["step"], r["launches"], f"{r['launches_per_layer']:.0f}", f"{r['bytes'] / 1e6:.1f}",
            f"{r['model_s'] * 1e3:.3f}", f"{r['pallas_bytes'] / 1e6:.1f}", f"{r['estimate_s'] * 1e3:.3f}",
            f"{r['bound_s'] * 1e3:.3f}", f"{r['estimate_over_bound']:.2f}x",
        ]
        for r in result["rows"]
    ]  # fmt: skip
    lines = [
        f"# Static roofline: Flash's first {result['layers']} layers on a deviceless {result['target']}",
        "",
        "Model figures from XLA's optimized HLO and cost model (`benchmarks/gpu_static.py`), not measurements: "
        "nothing ran on a GPU.",
        f"Bandwidth {result['bandwidth'] / 1e12:.2f} TB/s, bf16 peak {result['peak_bf16_flops'] / 1e12:.0f} TFLOP/s, "
        f"context {result['context']}, jax {result['jax']}.",
        "",
        markdown_table(head, table),
        "",
    ]
    for r in result["rows"]:
        lines += [f"## {r['kernels']}, {r['step']}: the {TOP_KERNELS} costliest kernels", ""]
        lines.append(
            markdown_table(
                ["scope", "kind", "launches", "MB per launch", "ms"],
                [
                    [
                        k["scope"] or "-",
                        k["kind"],
                        k["launches"],
                        f"{k['bytes_per_launch'] / 1e6:.3f}",
                        f"{k['seconds'] * 1e3:.4f}",
                    ]
                    for k in r["costliest"]
                ],  # fmt: skip
            )
        )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
