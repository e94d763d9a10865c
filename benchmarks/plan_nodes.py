"""`jaxserve plan --num-nodes N --devices-per-node 8` for DeepSeek-V4-Pro and -Flash (as released: FP4 experts, FP8
projections; bf16 KV) on 1, 2 and 4 nodes of 8 x H200 (141 GB) and 8 x H100 (80 GB): the README's table. Each row is
the layout `plan.node_layout` recommends (TP inside a node, EP across nodes) and `plan.make_plan` on it, with the
engine defaults (8 sequences, max_model_len 16384, 256-token prefill chunks); usable memory per device is JAX's share
(0.75 unless $XLA_CLIENT_MEM_FRACTION says otherwise), as `jaxserve plan --device-memory` counts it.

    .venv/bin/python benchmarks/plan_nodes.py   # ~15 minutes on 2 CPU cores: compiles each model's steps per mesh

Columns besides the plan's own: "KV (8 x 16K)" is the cache the engine allocates by default (max_num_seqs
sequences of max_model_len: `cache.kv_geometry`'s pages, plus the per-sequence state), "free" the usable memory left
after the weights, the step temporaries and that cache, and "16K sequences" the plan's KV tokens that fit over
16384: how many such sequences the devices hold at once with --max-num-seqs raised (an upper bound: each slot's
state and the larger decode step take a little of it). Writes benchmarks/results/plan_nodes.json and .md.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.model.cache import kv_geometry  # noqa: E402
from jaxserve.model.sharding import make_mesh  # noqa: E402
from jaxserve.presets import preset  # noqa: E402
from jaxserve.runner.plan import make_plan, node_layout, parameter_counts, plan_devices, usable_memory  # noqa: E402

MODELS = ["pro", "flash"]
NODE_COUNTS = [1, 2, 4]
DEVICES = [("H200", 141e9), ("H100", 80e9)]
PER_NODE = 8
RESULTS = Path(__file__).parent / "results"
GB = 1e9


def main() -> None:
    jax.config.update("jax_compilation_cache_dir", str(Path.home() / ".cache" / "jaxserve" / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    rows, sizes = [], {}
    for name in MODELS:
        cfg = preset(name, dtype="bfloat16")
        sizes[name] = parameter_counts(cfg)
        for nodes in NODE_COUNTS:
            layout = node_layout(cfg, nodes, PER_NODE)
            engine = EngineConfig(
                tensor_parallel_size=layout.tensor_parallel_size, expert_parallel_size=layout.expert_parallel_size
            )
            mesh = make_mesh(layout.tensor_parallel_size, layout.expert_parallel_size, plan_devices(nodes * PER_NODE))
            geometry = kv_geometry(engine, cfg)
            for device, memory in DEVICES:
                plan = make_plan(cfg, engine, mesh, usable_memory(int(memory)))
                kv = geometry.num_pages * geometry.page_size * plan.kv_bytes_per_token + plan.state_bytes_per_device
                rows.append(
                    {
                        "model": name,
                        "nodes": nodes,
                        "device": device,
                        "device_bytes": int(memory),
                        "layout": dataclasses.asdict(layout),
                        "default_kv_bytes_per_device": int(kv),
                        "free_bytes_per_device": None
                        if plan.temp_bytes_per_device is None
                        else int(plan.device_memory - plan.weights_bytes_per_device - plan.temp_bytes_per_device - kv),
                        **plan.to_json(),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_nodes.json").write_text(json.dumps({"parameters": sizes, "rows": rows}, indent=2) + "\n")
    lines = [
        "Parameters (`plan.parameter_counts`): "
        + "; ".join(f"{n} {t / 1e12:.2f}T, {a / 1e9:.1f}B active" for n, (t, a) in sizes.items())
        + ".",
        "",
        "| model | nodes | fits | TP x EP | weights / device | temporaries / device | KV (8 x 16K) / device | "
        "free / device | KV tokens that fit | 16K sequences | requests of 16K at once (8 slots) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        layout, compiled = r["layout"], r["temp_bytes_per_device"] is not None
        cells = [
            r["model"].capitalize(),
            f"{r['nodes']} x 8 x {r['device']} ({r['device_bytes'] / GB:.0f} GB)",
            "yes" if r["fits"] else "no: " + r["reason"],
            f"{layout['tensor_parallel_size']} x {layout['expert_parallel_size']}",
            *(
                "-" if value is None else f"{value / GB:.1f} GB"
                for value in (
                    r["weights_bytes_per_device"],
                    r["temp_bytes_per_device"],
                    r["default_kv_bytes_per_device"] if compiled else None,
                    r["free_bytes_per_device"],
                )
            ),
            f"{r['max_kv_tokens']:,}",
            f"{r['max_kv_tokens'] // r['max_model_len']:,}",
            str(r["max_concurrent_requests"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    (RESULTS / "plan_nodes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
