"""`jaxserve plan` for DeepSeek-V4-Flash on 8-device nodes (H200 141 GB, H100 80 GB, RTX 4090 24 GB), as released
(FP4 experts, FP8 projections) with a bf16 and an FP8 KV cache, and dequantized to bf16: the README's table. Usable
memory per device is JAX's share ($XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75), as `jaxserve plan --device-memory`
counts it.

    .venv/bin/python benchmarks/plan_flash.py   # ~minutes on CPU: compiles Flash's decode and prefill steps

Writes benchmarks/results/plan_flash.json and .md.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.model.sharding import make_mesh  # noqa: E402
from jaxserve.presets import preset  # noqa: E402
from jaxserve.runner.plan import make_plan, usable_memory  # noqa: E402

NODES = [("8 x H200", 141e9), ("8 x H100", 80e9), ("8 x RTX 4090", 24e9)]
MESHES = [(8, 1), (4, 2)]
VARIANTS = [("auto", "bfloat16"), ("auto", "fp8"), ("none", "bfloat16")]  # (--quantization, --kv-cache-dtype)
RESULTS = Path(__file__).parent / "results"


def main() -> None:
    jax.config.update("jax_compilation_cache_dir", str(Path.home() / ".cache" / "jaxserve" / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    engine = EngineConfig(tensor_parallel_size=8)  # max_num_seqs 8, max_model_len 16384, 256-token prefill chunks
    rows = []
    for quantization, kv_cache_dtype in VARIANTS:
        cfg = preset("flash", dtype="bfloat16").with_quantization(quantization)
        knobs = dataclasses.replace(engine, kv_cache_dtype=kv_cache_dtype)
        for tp, ep in MESHES:
            for node, memory in NODES:
                plan = make_plan(cfg, knobs, make_mesh(tp, ep), usable_memory(int(memory)))
                rows.append(
                    {
                        "node": node,
                        "quantization": quantization,
                        "kv_cache_dtype": kv_cache_dtype,
                        "tensor_parallel_size": tp,
                        "expert_parallel_size": ep,
                        **plan.to_json(),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_flash.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "| node | weights | KV | TP x EP | weights / device | temporaries / device | KV tokens that fit | "
        "requests of 16K at once | fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        temp = "-" if r["temp_bytes_per_device"] is None else f"{r['temp_bytes_per_device'] / 1e9:.1f} GB"
        lines.append(
            f"| {r['node']} | {'FP8/FP4' if r['quantization'] == 'auto' else 'bf16'} | "
            f"{'fp8' if r['kv_cache_dtype'] == 'fp8' else 'bf16'} | "
            f"{r['tensor_parallel_size']} x {r['expert_parallel_size']} | "
            f"{r['weights_bytes_per_device'] / 1e9:.1f} GB | {temp} | {r['max_kv_tokens']:,} | "
            f"{r['max_concurrent_requests']} | {'yes' if r['fits'] else 'no: ' + r['reason']} |"
        )
    (RESULTS / "plan_flash.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
