"""Quantized weights on an accelerator: FP8 / FP4 matmuls against bf16 ones at DeepSeek-V4-Flash's shapes (time and
result), and the decode step of a few Flash-sized layers against the weight-bandwidth bound.

    .venv/bin/python benchmarks/quant_gpu.py [--layers 4] [--batch 8] [--bandwidth 4.8e12]   # on a GPU
    .venv/bin/python benchmarks/quant_gpu.py --smoke                                         # tiny sizes, CPU

The bound: a decode step must read every weight it uses once, so it takes at least (bytes read) / (memory
bandwidth): the attention and shared-expert weights, the embedding row and the head, and the routed experts the
batch's tokens pick (at most min(experts, batch x top-k) per layer). Writes benchmarks/results/quant_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.kernels.moe import grouped_matmul
from jaxserve.kernels.quant import FP4, FP8, dequantize, einsum, quantize
from jaxserve.model.cache import kv_geometry
from jaxserve.model.sharding import make_mesh
from jaxserve.model.weights import init_weights, weights_nbytes
from jaxserve.presets import preset
from jaxserve.request import Request, SamplingParams
from jaxserve.request.batch import StepBatch
from jaxserve.request.step import StepPlan
from jaxserve.runner import Buckets, ModelRunner

RESULTS = Path(__file__).parent / "results"


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def matmuls(tokens: int, sizes: dict, repeats: int) -> list[dict]:
    """Projections (FP8, 128x128 blocks) and the grouped routed-expert matmul (FP4, 1x32) against bf16."""
    key = jax.random.key(0)
    rows = []
    cases = [
        (f"{name} [{d_in}x{d_out}] fp8", (d_in, d_out), FP8, (128, 128))
        for name, (d_in, d_out) in sizes["projections"].items()
    ]
    e, d, f = sizes["experts"]
    cases.append((f"experts [{e}x{d}x{f}] fp4", (e, d, f), FP4, (1, 32, 1)))
    for name, shape, fmt, blocks in cases:
        w = 0.02 * jax.random.normal(key, shape, jnp.float32)
        q = quantize(w, fmt, blocks)
        w16 = dequantize(q, jnp.bfloat16)  # the same values, dense
        x = jax.random.normal(key, (tokens, shape[-2]), jnp.bfloat16)
        if len(shape) == 2:
            quantized = jax.jit(lambda x, q: einsum("md,df->mf", x, q))
            dense = jax.jit(lambda x, w: jnp.einsum("md,df->mf", x, w))
            args_q, args_d = (x, q), (x, w16)
        else:
            groups = jnp.full((e,), tokens // e, jnp.int32).at[0].add(tokens % e)
            quantized = jax.jit(lambda x, q, g: grouped_matmul(x, q, g))
            dense = jax.jit(lambda x, w, g: grouped_matmul(x, w, g))
            args_q, args_d = (x, q, groups), (x, w16, groups)
        got, want = np.asarray(quantized(*args_q), np.float32), np.asarray(dense(*args_d), np.float32)
        rows.append(
            {
                "case": name,
                "tokens": tokens,
                "quantized_s": timed(quantized, *args_q, repeats=repeats),
                "bf16_s": timed(dense, *args_d, repeats=repeats),
                "max_abs_diff": float(np.abs(got - want).max()),
                "max_abs": float(np.abs(want).max()),
                "weight_bytes_quantized": weights_nbytes(q),
                "weight_bytes_bf16": w16.nbytes,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def decode_step(preset_name: str, layers: int, batch: int, bandwidth: float, repeats: int) -> dict:
    """One decode step of `layers` layers of the preset, its weights as released, on one device."""
    cfg = preset(preset_name, dtype="bfloat16", num_hidden_layers=layers)
    weights = init_weights(jax.random.key(1), cfg)
    engine = EngineConfig(max_num_seqs=batch, max_model_len=256, chunked_prefill_size=16, max_prefill_rows=1)
    runner = ModelRunner(
        cfg,
        weights,
        kv_geometry(engine, cfg),
        make_mesh(1, 1),
        Buckets(prefill_rows=(1,), prefill_chunks=(16,), decode_rows=(batch,)),
    )
    runner.warmup()
    requests = []
    for slot in range(batch):
        request = Request(f"r{slot}", [2, 3, 4], SamplingParams(max_tokens=8))
        request.slot, request.pages, request.num_sampled = slot, [slot * 2], 1
        requests.append(request)
    seconds = statistics.median(runner.device_seconds(StepBatch.of(StepPlan.decode_of(requests)), repeats))
    total = weights_nbytes(weights)
    experts = sum(
        weights_nbytes([layer.moe.w_gate, layer.moe.w_up, layer.moe.w_down])
        for segment in weights.segments
        for layer in segment
    )
    used = min(cfg.n_routed_experts, batch * cfg.num_experts_per_tok) / cfg.n_routed_experts
    embed_and_head = weights_nbytes([weights.embed, weights.head])
    read = total - experts - embed_and_head + experts * used + weights.head.nbytes
    return {
        "preset": preset_name,
        "layers": layers,
        "batch": batch,
        "step_s": seconds,
        "weights_bytes": total,
        "bytes_read_bound": read,
        "bandwidth": bandwidth,
        "bound_s": read / bandwidth,
        "fraction_of_bound": (read / bandwidth) / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script on a CPU")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="rows of the matmul benchmarks")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s of device memory (H200: 4.8e12)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.smoke:
        sizes = {"projections": {"wq_a": (160, 24)}, "experts": (8, 160, 64)}
        name, layers, batch, tokens, repeats = "tiny", 2, 2, 16, 2
    else:
        sizes = {
            "projections": {
                "wq_a": (4096, 1024),
                "wq_b": (1024, 32768),
                "wo_b": (8192, 4096),
                "shared_gate": (4096, 2048),
            },
            "experts": (256, 4096, 2048),
        }
        name, layers, batch, tokens, repeats = "flash", args.layers, args.batch, args.tokens, args.repeats
    report = {
        "device": str(jax.devices()[0]),
        "matmuls": matmuls(tokens, sizes, repeats),
        "decode": decode_step(name, layers, batch, args.bandwidth, repeats),
    }
    print(json.dumps(report["decode"]), flush=True)
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "quant_gpu.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
