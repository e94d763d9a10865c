"""DeepSeek-V4-Flash layers on one accelerator against their rooflines: the decode step against the HBM bound of the
bytes it must read, a prefill chunk against the bf16 compute bound, the tiny default model's decode period (device
and host), a profile of the batch-8 decode step, and XLA command buffers extended to loops and conditionals.

    .venv/bin/python benchmarks/gpu_roofline.py                   # on a GPU (H200 defaults), at most ~8 minutes
    .venv/bin/python benchmarks/gpu_roofline.py --cpu-smoke --out /tmp/roofline   # tiny shapes on CPU, a dry run
    JAX_PLATFORMS=cuda .venv/bin/python benchmarks/gpu_roofline.py --cpu-smoke --out /tmp/roofline  # tiny, on a GPU

Flags: --kernels (repeatable, or a comma list; default reference and pallas, side by side), --bandwidth (bytes/s,
default 4.8e12), --peak-bf16 (FLOP/s, default 989e12), --layers (default 4), --context (default 4096; 128 with
--cpu-smoke). Writes gpu_roofline.json and gpu_roofline.md under --out (default benchmarks/results); --cpu-smoke
writes gpu_roofline_cpu_smoke.* there instead, so a dry run never replaces a GPU run's results.

What runs (TP 1, the release's storage: FP8 projections, FP4 routed experts; `kv_cache_dtype="fp8"`):
- the model: the first --layers layers of `preset("flash")` (4: two SWA layers and a CSA layer, hash-routed, then
  an HCA layer), with random weights drawn on the host directly in their storage form (random code bytes, fixed
  power-of-two scales: nothing is compiled to make them; leaves over 2^24 values repeat their first 2^24).
  --cpu-smoke: the `tiny` preset at the sizes tests/test_quantized_weights.py uses, with the same layer kinds,
  FP8 / FP4 storage and FP8 KV, compiled with XLA:CPU's cheapest settings. One runner per --kernels choice, in
  turn; each compiles all its step shapes at once, in threads;
- decode at batch 1, 8 and 64 (--cpu-smoke: 1 and 8), every row at position --context: the KV state is not filled
  by prefill (64 rows x 4K tokens of prefill would take longer than the whole budget); each row has its own pages
  and its position says the step attends --context tokens, so it gathers, masks and reads exactly what a filled
  cache would make it read. The content is the cache's initial zeros: neither the bytes nor the FLOPs depend on
  it. Rows sample at temperature 1 with their own seeds, so after one untimed step every row feeds its own token
  and the batch routes to different experts (all rows start from token 0). `step_s`: the median over repeats of
  `runner.device_seconds(batch, repeats, back_to_back=4)` (the device's pace when never left waiting);
  `latency_s`: the same with one call per wait;
- the per-kind rows (`swa_hash`, `csa_hash`, `hca`, and `outside_layers` for the embedding, HC head, final norm,
  head and sampling): from a profile of a few steps of the same batch (`runner.run`), each trace op mapped to its
  layer kind through the compiled step's HLO metadata (the model's `named_scope`s; an op of a layer scan outside
  any kind's scope, such as slicing the next layer's stacked weights, goes to its segment's kind when all that
  segment's layers are of one kind, else it stays unattributed, as ops without metadata do). A part's `step_s` is
  the step's time times the part's share of the traced kernel time, per layer of that kind; `kernel_s` the kernel
  time alone. Not a separate model per kind and not a difference of models: those would compile 9 more step
  shapes per implementation, which does not fit the time budget;
- prefill: one chunk of 2048 tokens (--cpu-smoke: 64), batch 1, the chunk that ends at --context;
- the tiny default model (embedded checkpoint, float32, as benchmarks/async_loop.py loads it) in a child process
  with the first --kernels choice: the engine loop's decode period at batch 1, the device's share
  (`device_seconds`, back to back) and the host's (period minus device). On a GPU a second child runs it with
  `XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL`; the
  children run before this process touches the GPU;
- the profile: `jax.profiler.trace` of the batch-8 decode steps through `runner.run` (host inputs, the step, the
  sampled tokens' copy back), parsed from the trace file: on a GPU the kernels and copies on the device's stream
  lines, on CPU the XLA:CPU ops; a trace that cannot be read is recorded as the reason, never a crash.

How the decode bound counts bytes: `decode_bytes`; how the prefill bound counts FLOPs: `prefill_flops` (their
docstrings are copied into the markdown). The bound is a lower bound on time: bytes / --bandwidth, FLOPs / --peak-bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import gzip
import inspect
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from common import COMPILE_CACHE, markdown_table

from jaxserve.checkpoints.load import load_model
from jaxserve.config import CSA, HCA, SWA, EngineConfig, ModelConfig, to_hf_dict
from jaxserve.engine import Engine
from jaxserve.kernels.quant import FP4, FP8, Quantized
from jaxserve.kernels.table import KERNEL_CHOICES, kernels_for
from jaxserve.model.cache import CacheGeometry, abstract_cache, kv_geometry
from jaxserve.model.segments import LayerKind, layer_segments
from jaxserve.model.sharding import make_mesh, shardings_for
from jaxserve.model.weights import ArrayInfo, abstract_weights, is_info, is_weight, weights_nbytes
from jaxserve.presets import preset
from jaxserve.request import Request, SamplingParams
from jaxserve.request.batch import StepBatch
from jaxserve.request.step import GroupShape, StepKind, StepPlan, StepRow, StepShape
from jaxserve.runner import Buckets, ModelRunner, build_runner
from jaxserve.runner.hlo_profile import step_profile
from jaxserve.runner.targets import CHEAP_CPU_COMPILE_FLAGS, add_xla_flags, ask_for_cost_model

RESULTS = Path(__file__).resolve().parent / "results"
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
CHILD_MARK = "GPU_ROOFLINE_TINY "  # the child's result line on stdout
CHILD_TIMEOUT_S = 300
PROFILE_BATCH = 8
TOP_KERNELS = 10
# Random codes with fixed power-of-two scales: e4m3 bytes (RMS ~120) x 2^-14 and e2m1 nibbles (RMS ~3) x 2^-8 put
# the weights near 0.01, like the 0.02-std draws of init_weights, with no NaN scale (byte 255) or code.
SCALE_BYTE = {FP8: 127 - 14, FP4: 127 - 8}
RANDOM_BLOCK = 1 << 24  # random values drawn per leaf; a bigger leaf repeats them
STARTED = time.perf_counter()
SETUP = __doc__[__doc__.index("What runs") : __doc__.index("How the decode bound")].strip()  # for the markdown


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    smoke: bool
    layers: int
    context: int  # every decode row's position; the prefill chunk ends there
    chunk: int  # prefill tokens
    batches: tuple[int, ...]
    repeats: int
    back_to_back: int
    trace_steps: int
    tiny_tokens: int  # tokens the tiny model's engine run generates
    tiny_repeats: int


def make_plan(args: argparse.Namespace) -> Plan:
    if args.cpu_smoke:
        context = args.context or 128
        return Plan(
            True,
            args.layers,
            context,
            min(64, context),
            (1, PROFILE_BATCH),
            repeats=2,
            back_to_back=2,
            trace_steps=2,
            tiny_tokens=16,
            tiny_repeats=3,
        )
    context = args.context or 4096
    return Plan(
        False,
        args.layers,
        context,
        min(2048, context),
        (1, PROFILE_BATCH, 64),
        repeats=10,
        back_to_back=4,
        trace_steps=3,
        tiny_tokens=128,
        tiny_repeats=20,
    )


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


# ---- the model ----------------------------------------------------------------------------------------------------


def model_config(plan: Plan) -> ModelConfig:
    """Flash's first `plan.layers` layers in bfloat16 as released; --cpu-smoke: the tiny preset with the same layer
    kinds and routing, FP8 projections, FP4 experts (sizes whose blocks the storage allows)."""
    flash = preset("flash", dtype="bfloat16", num_hidden_layers=plan.layers)
    if not plan.smoke:
        return flash
    kinds = to_hf_dict(flash)
    tiny = preset(
        "tiny",
        dtype="bfloat16",
        num_hidden_layers=plan.layers,
        hidden_size=160,
        moe_intermediate_size=64,
        head_dim=64,
        o_lora_rank=128,
        layer_types=kinds["layer_types"],
        mlp_layer_types=kinds["mlp_layer_types"],
    )
    return tiny.__class__(**{**tiny.__dict__, "linear_format": FP8, "expert_format": FP4})


def repeated(block: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`block`'s values repeated to fill `shape`: drawing all of Flash's 16 GB on the host took minutes, and which
    values the weights have changes nothing a step reads or computes."""
    return np.resize(block, math.prod(shape)).reshape(shape)


def random_array(rng: np.random.Generator, info: ArrayInfo, n_experts: int) -> np.ndarray:
    dtype = jnp.dtype(info.dtype)
    if info.init == "ones":
        return np.ones(info.shape, dtype)
    if info.init == "zeros":
        return np.zeros(info.shape, dtype)
    if info.init == "expert_ids":  # distinct experts per token, like a real tid2eid table
        noise = rng.random((*info.shape[:-1], n_experts), dtype=np.float32)
        return np.argpartition(noise, info.shape[-1] - 1, axis=-1)[..., : info.shape[-1]].astype(dtype)
    std = 0.5 if info.init == "small" else 0.02
    block = std * rng.standard_normal(min(math.prod(info.shape), RANDOM_BLOCK), dtype=np.float32)
    return repeated(block.astype(dtype), info.shape)


def random_codes(rng: np.random.Generator, info: Quantized) -> Quantized:
    """Random code bytes (two e2m1 nibbles each for FP4) and one fixed scale byte for every block."""
    block = np.frombuffer(rng.bytes(min(math.prod(info.codes.shape), RANDOM_BLOCK)), np.uint8)
    if info.format == FP8:
        block = np.where((block & 0x7F) == 0x7F, block ^ 1, block).view(jnp.float8_e4m3fn)  # 0x7F, 0xFF: NaN
    return Quantized(
        repeated(block, info.codes.shape),
        np.full(info.scales.shape, SCALE_BYTE[info.format], np.uint8),
        info.format,
        info.blocks,
    )


def random_weights(cfg: ModelConfig, mesh, seed: int = 0):
    """Random weights in their storage form, each leaf drawn on the host and put straight onto its sharding: no
    compile (XLA:CPU takes about a second per random or quantize leaf, minutes for a model) and no f32 copies of
    Flash's expert stacks on the device."""
    rng = np.random.default_rng(seed)
    abstract = abstract_weights(cfg)

    def leaf(info, sharding):
        value = (
            random_codes(rng, info) if isinstance(info, Quantized) else random_array(rng, info, cfg.n_routed_experts)
        )
        return jax.tree.map(jax.device_put, value, sharding)

    return jax.tree.map(leaf, abstract, shardings_for(abstract, mesh), is_leaf=is_weight)


# ---- what a step must read and compute ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerCost:
    """One layer's storage and parameters, from the abstract weights and cache (nothing allocated)."""

    part: str  # the model's scope name for its kind: swa, swa_hash, csa, csa_hash, hca, hca_hash
    attention: str  # SWA | CSA | HCA
    hashed: bool
    weight_bytes: float  # every weight but the routed experts and the hash table: codes + scales where quantized
    expert_bytes: float  # one routed expert: gate, up and down, codes + scales
    table_row_bytes: float  # one token's row of the hash-routing table (0: routed by the router)
    dense_params: float  # decoded elements of the weights in weight_bytes
    expert_params: float  # decoded elements of one routed expert
    window_entry_bytes: float  # one K=V vector of the window ring, as stored
    entry_bytes: float  # one compressed K=V entry, as stored (0: SWA)
    index_entry_bytes: float  # one indexer key, as stored (0: not CSA)
    state_bytes: float  # the compressor states of one slot (0: SWA)


def elements(tree: Any) -> int:
    """Decoded elements of the weights in an abstract tree (a Quantized weight counts its logical shape)."""
    return sum(math.prod(w.shape) for w in jax.tree.leaves(tree, is_leaf=is_weight))


def part_name(kind: LayerKind) -> str:
    """A layer kind as the model's named_scope calls it (swa, swa_hash, csa, ...): the name of its part."""
    return f"{kind.attention}_hash" if kind.hashed else kind.attention


def bytes_per(store: Any, axes: int) -> float:
    """Bytes of a stacked store per element of its first `axes` axes (layers x slots x ring, layers x pages x ...)."""
    leaves = jax.tree.leaves(store, is_leaf=is_info)
    return weights_nbytes(store) / math.prod(leaves[0].shape[:axes]) if leaves else 0.0


def layer_costs(cfg: ModelConfig, geo: CacheGeometry) -> list[LayerCost]:
    """Every layer's LayerCost in model order (a stack's totals over its repeats)."""
    weights, cache = abstract_weights(cfg), abstract_cache(cfg, geo)
    by_layer: dict[int, LayerCost] = {}
    for segment, layer_stacks, cache_stacks in zip(layer_segments(cfg), weights.segments, cache):
        for position, (kind, layer, kv) in enumerate(zip(segment.pattern, layer_stacks, cache_stacks)):
            moe, n = layer.moe, segment.repeats
            experts = [moe.w_gate, moe.w_up, moe.w_down]
            table = weights_nbytes(moe.tid2eid)
            cost = LayerCost(
                part=part_name(kind),
                attention=kind.attention,
                hashed=kind.hashed,
                weight_bytes=(weights_nbytes(layer) - weights_nbytes(experts) - table) / n,
                expert_bytes=weights_nbytes(experts) / (n * cfg.n_routed_experts),
                table_row_bytes=table / (n * cfg.vocab_size),
                dense_params=(elements(layer) - elements(experts) - elements(moe.tid2eid)) / n,
                expert_params=elements(experts) / (n * cfg.n_routed_experts),
                window_entry_bytes=bytes_per(kv.window, 3),
                entry_bytes=bytes_per(kv.entries, 3),
                index_entry_bytes=bytes_per(kv.index_entries, 3),
                state_bytes=bytes_per([kv.state, kv.index_state], 2),
            )
            for repeat in range(n):
                by_layer[segment.layer(repeat, position)] = cost
    return [by_layer[i] for i in range(cfg.num_layers)]


def layer_bytes(cost: LayerCost, cfg: ModelConfig, batch: int, context: int) -> dict[str, float]:
    """One layer's share of `decode_bytes`."""
    csa_entries, hca_entries = (context + 1) // cfg.csa_rate, (context + 1) // cfg.hca_rate
    compressed = {
        SWA: 0.0,
        CSA: csa_entries * cost.index_entry_bytes + min(cfg.index_topk, csa_entries) * cost.entry_bytes,
        HCA: hca_entries * cost.entry_bytes,
    }[cost.attention]
    return {
        "layer_weights": cost.weight_bytes,
        "routed_experts": min(cfg.n_routed_experts, batch * cfg.num_experts_per_tok) * cost.expert_bytes,
        "hash_table_rows": batch * cost.table_row_bytes,
        "kv_window": batch * cfg.sliding_window * cost.window_entry_bytes,
        "kv_compressed": batch * compressed,
        "compressor_state": batch * cost.state_bytes,
    }


def outside_bytes(cfg: ModelConfig, batch: int) -> dict[str, float]:
    """`decode_bytes` outside the layers."""
    w = abstract_weights(cfg)
    return {
        "embedding_rows": batch * cfg.hidden_size * jnp.dtype(w.embed.dtype).itemsize,
        "head_and_final": weights_nbytes([w.head, w.hc_head_fn, w.hc_head_base, w.hc_head_scale, w.norm]),
    }


def decode_bytes(costs: list[LayerCost], cfg: ModelConfig, batch: int, context: int) -> dict[str, float]:
    """Bytes a decode step of `batch` rows at position `context` must read at least once, at their storage size
    (FP8 / FP4 codes plus their ue8m0 scale bytes; the FP8 KV cache's e4m3 codes, scale bytes and bfloat16 RoPE
    dims; compressor state in float32), from the abstract weights and cache:
    - layer_weights: every weight of each layer except its routed experts and its hash table: attention (wq_a,
      wq_b, wkv, wo_a, wo_b, norms, sinks), the compressors and indexer (CSA / HCA), the shared expert, the router,
      the two hyper-connections; read once per step whatever the batch;
    - routed_experts: per layer, min(experts, batch x top-k) whole experts (gate, up, down), the most the batch's
      tokens can pick, each at its storage size;
    - hash_table_rows: per hash-routed layer, each row's token's row of the token -> experts table (int32 x top-k);
    - embedding_rows: one embedding row per row of the batch; head_and_final: the whole head once, plus the HC
      head and the final norm;
    - kv_window: per layer and row, the window ring's `sliding_window` K=V vectors;
    - kv_compressed: per row, CSA layers: every visible indexer key ((context + 1) // csa_rate of them: the
      indexer scores them all) plus the top-k (index_topk) compressed entries the attention reads; HCA layers:
      every visible compressed entry ((context + 1) // hca_rate);
    - compressor_state: per CSA / HCA layer and row, its compressors' buffered window (read every step).
    Not counted: activations, the sampled tokens, anything written, and reads past the visible entries that the
    implementation makes (its page tables cover max_model_len, a page more than the context)."""
    total: dict[str, float] = dict(outside_bytes(cfg, batch))
    for cost in costs:
        for item, value in layer_bytes(cost, cfg, batch, context).items():
            total[item] = total.get(item, 0.0) + value
    return total


def prefill_flops(costs: list[LayerCost], cfg: ModelConfig, start: int, tokens: int) -> dict[str, float]:
    """FLOPs of a prefill chunk of `tokens` tokens at positions start .. start + tokens - 1, batch 1:
    - matmuls: 2 x active params x tokens, active params per token = every decoded weight element of each layer
      except its routed experts and hash table (attention, compressors, indexer, shared expert, router,
      hyper-connections) plus top-k routed experts' (gate, up, down);
    - head: 2 x hidden x vocab once (only the chunk's last token's logits are computed; the embedding is a lookup);
    - attention: per layer, query token at position p and head: 4 x head_dim FLOPs (QK and PV) per key it attends:
      min(window, p + 1) window keys in every layer, plus CSA: min(index_topk, (p + 1) // csa_rate) selected
      entries and the indexer's 2 x index_heads x index_head_dim per visible key; HCA: (p + 1) // hca_rate entries.
    The bound is their sum / --peak-bf16 (the matmuls run in bfloat16 after decoding the FP8 / FP4 codes)."""
    seen = np.arange(start, start + tokens, dtype=np.int64) + 1
    per_key = 4 * cfg.num_heads * cfg.head_dim
    window = per_key * np.minimum(cfg.sliding_window, seen).sum()
    csa_entries = seen // cfg.csa_rate
    extra = {
        SWA: 0,
        CSA: per_key * np.minimum(cfg.index_topk, csa_entries).sum()
        + 2 * cfg.index_n_heads * cfg.index_head_dim * csa_entries.sum(),
        HCA: per_key * (seen // cfg.hca_rate).sum(),
    }
    flops = {
        "matmuls": 2.0 * tokens * sum(c.dense_params + cfg.num_experts_per_tok * c.expert_params for c in costs),
        "head": 2.0 * cfg.hidden_size * cfg.vocab_size,
        "attention": float(sum(window + extra[c.attention] for c in costs)),
    }
    return {**flops, "total": sum(flops.values())}


# ---- the runner and its inputs ------------------------------------------------------------------------------------


def geometry_for(cfg: ModelConfig, plan: Plan) -> CacheGeometry:
    """A slot per row of the largest batch, each with pages up to the context plus one page (the profiled steps
    advance a few positions); FP8 KV."""
    page_size = EngineConfig().page_size
    engine = EngineConfig(
        max_num_seqs=max(plan.batches),
        max_model_len=plan.context + page_size,
        page_size=page_size,
        kv_cache_dtype="fp8",
    )
    return kv_geometry(engine, cfg)


def slot_pages(geo: CacheGeometry, slot: int) -> list[int]:
    return list(range(slot * geo.max_pages_per_seq, (slot + 1) * geo.max_pages_per_seq))


def decode_rows(geo: CacheGeometry, batch: int, context: int) -> StepBatch:
    """`batch` decode rows in their own slots and pages, each at position `context`, sampling with its own seed."""
    return StepBatch.of(
        StepPlan.decode_of(
            [
                Request(
                    f"d{i}",
                    [1] * context,
                    SamplingParams(temperature=1.0, seed=i),
                    slot=i,
                    num_sampled=1,
                    pages=slot_pages(geo, i),
                )
                for i in range(batch)
            ]
        )
    )


def prefill_chunk(geo: CacheGeometry, cfg: ModelConfig, plan: Plan) -> StepBatch:
    """Slot 0's prompt of `context` random tokens; the chunk of its last `chunk` tokens."""
    tokens = np.random.default_rng(1).integers(2, cfg.vocab_size, plan.context).tolist()
    request = Request("prefill", tokens, SamplingParams(temperature=1.0, seed=0), slot=0, pages=slot_pages(geo, 0))
    return StepBatch.of(StepPlan(prefill=(StepRow.chunk(request, plan.context - plan.chunk, plan.chunk),)))


def compiled_text(runner: ModelRunner, shape) -> str:
    """The optimized HLO of the shape's executables (ModelRunner.executables) as one text (every module's metadata
    names the trace's ops)."""
    return "\n".join(compiled.as_text() for compiled in runner.executables(shape))


def static_estimate(runner: ModelRunner, shape, bandwidth: float) -> dict:
    """What benchmarks/gpu_static.py estimates for the step of `shape` without a GPU, here from this GPU's own
    compile: the forward's and its plain sampler's kernels (jaxserve.runner.hlo_profile), so the model's error
    shows beside the measured time. The cost model's times need targets.COST_MODEL_FLAG (configure asks for it)."""
    profile = step_profile(runner.executables(shape)[:2])
    return {
        "static_estimate_s": profile.estimate(bandwidth),
        "static_launches": profile.launches,
        "static_model_s": profile.model_seconds(),
    }


# ---- profiles -----------------------------------------------------------------------------------------------------

COPY_NAME = re.compile(r"memcpy|memset", re.IGNORECASE)  # the runtime's copies (an XLA copy op is a kernel)
D2H_NAME = re.compile(r"d2h|dtoh|device\s*to\s*host", re.IGNORECASE)
HLO_OP_NAME = re.compile(r"[a-z][a-z0-9_\-]*(\.\d+)*")  # how XLA:CPU names its ops when the trace has no args
HLO_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s*=")
HLO_OP_NAME_META = re.compile(r'metadata=\{[^}]*?op_name="([^"]*)"')
HLO_CALLS = re.compile(r"\b(?:calls|to_apply|body)=%?([\w.\-]+)")
KIND_SCOPE = re.compile(r"(?:^|/)((?:swa|csa|hca)(?:_hash)?)(?:/|$)")
SEGMENT_SCOPE = re.compile(r"(?:^|/)(segment_\d+)(?:/|$)")
OUTSIDE, UNATTRIBUTED = "outside_layers", "unattributed"
PROFILER_OPTIONS = inspect.signature(jax.profiler.trace).parameters


def load_trace(folder: str) -> dict:
    """The trace `jax.profiler.trace` wrote: the Perfetto JSON (its events carry hlo_op / hlo_module), else the
    trace viewer's."""
    for pattern in ("perfetto_trace.json.gz", "*.trace.json.gz"):
        paths = sorted(glob.glob(f"{folder}/plugins/profile/*/{pattern}"))
        if paths:
            with gzip.open(paths[-1]) as f:
                return json.load(f)
    found = [os.path.relpath(p, folder) for p in glob.glob(f"{folder}/**", recursive=True) if os.path.isfile(p)]
    raise FileNotFoundError(f"no trace JSON among the profiler's files {found}")


def device_lines(events: list[dict]) -> tuple[set, str]:
    """The (pid, tid) lines whose events are device work, and what they are: a GPU's stream lines (not the lines
    the trace derives from them: XLA Ops, XLA Modules, Steps, ...); none on CPU (its ops run on host threads)."""
    processes = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    threads = {
        (e["pid"], e.get("tid")): e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    devices = {pid for pid, name in processes.items() if "/device:" in name}
    lines = {line for line in threads if line[0] in devices}
    streams = {line for line in lines if threads[line].lower().startswith("stream")}
    if streams:
        return streams, "device kernels and copies on the stream lines of " + ", ".join(processes[p] for p in devices)
    derived = re.compile(r"xla|step|scope|source|framework|module|launch", re.IGNORECASE)
    kept = {line for line in lines if not derived.search(threads[line])}
    return kept, "events of the device process's lines " + ", ".join(sorted(threads[line] for line in kept))


def exclusive_seconds(events: list[dict]) -> list[tuple[dict, float]]:
    """Each event with its own time: its duration less that of the events inside it on its line (XLA:CPU traces a
    while loop and the ops of its body; kernels on a GPU stream follow one another, at most touching)."""
    lines: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        lines[(e["pid"], e.get("tid"))].append(e)
    own: dict[int, float] = {}
    for line in lines.values():
        line.sort(key=lambda e: (e["ts"], -e["dur"]))
        enclosing: list[dict] = []
        for e in line:
            while enclosing and e["ts"] + e["dur"] > enclosing[-1]["ts"] + enclosing[-1]["dur"] + 1e-3:
                enclosing.pop()  # it ends after the last open event: not inside it
            if enclosing:
                own[id(enclosing[-1])] -= e["dur"]
            own[id(e)] = e["dur"]
            enclosing.append(e)
    return [(e, max(own[id(e)], 0.0) / 1e6) for e in events]


def hlo_scopes(hlo_text: str) -> tuple[str | None, dict[str, str]]:
    """(the module's name, instruction name -> op_name metadata), under its own name and as a kernel name (GPU
    kernels are named after their fusion with '.' and '-' made '_'). An instruction without metadata (XLA:CPU's
    fusions have none) takes that of the computation it calls: its root's, else the first it has."""
    module = re.search(r"HloModule\s+([\w.\-]+)", hlo_text)
    own: dict[str, str] = {}
    calls: dict[str, str] = {}
    of_computation: dict[str, str] = {}
    computation = ""
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):  # a computation's header
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            continue
        found = HLO_INSTRUCTION.match(line)
        if not found:
            continue
        name, meta, callee = found.group(2), HLO_OP_NAME_META.search(line), HLO_CALLS.search(line)
        if meta:
            own[name] = meta.group(1)
            if found.group(1) or computation not in of_computation:
                of_computation[computation] = meta.group(1)
        if callee:
            calls[name] = callee.group(1)
    scopes = {}
    for name in own.keys() | calls.keys():
        scope = own.get(name) or of_computation.get(calls.get(name, ""))
        if scope:
            scopes[name] = scope
            scopes.setdefault(re.sub(r"[.\-]", "_", name), scope)
    return (module.group(1) if module else None), scopes


def short_scope(op_name: str) -> str:
    return "/".join(re.sub(r"jit\([^)]*\)/|while/body/|closed_call/", "", op_name).split("/")[:6])


def step_events(trace: dict, on_cpu: bool) -> tuple[list[dict], list[dict] | None, str]:
    """(kernel events, copy events (None on CPU: device buffers are host memory), where they came from) of the
    traced steps."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lines, source = device_lines(events)
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if not on_cpu:
        if not lines:  # e.g. no CUPTI: the host's launch events are no measure of the device
            processes = sorted({e.get("args", {}).get("name", "") for e in events if e.get("name") == "process_name"})
            raise ValueError(f"the trace has no device lines (its processes: {processes})")
        on_device = [e for e in complete if (e["pid"], e.get("tid")) in lines]
        return (
            [e for e in on_device if not COPY_NAME.search(e["name"])],
            [e for e in on_device if COPY_NAME.search(e["name"])],
            source,
        )
    ops = [e for e in complete if "hlo_op" in e.get("args", {}) and not e["name"].startswith("end: ")]
    if not ops:  # a trace without args: XLA:CPU ops are the events named like HLO instructions
        ops = [e for e in complete if HLO_OP_NAME.fullmatch(e["name"])]
    return ops, None, "XLA:CPU ops on the host's threads"


def of_module(events: list[dict], module: str | None) -> list[dict]:
    """The events of the step's own executable, where the trace names modules (all of them where it does not, or
    where no name matches: a naming difference must not empty the profile)."""
    mine = [e for e in events if e.get("args", {}).get("hlo_module") in (None, module)]
    return mine if module and mine else events


def segment_parts(cfg: ModelConfig) -> dict[str, str]:
    """The part of each segment whose layers are all of one kind (`segment_2` -> `csa_hash`): the work its layer
    scan does outside any kind's scope (slicing the stacked weights of the next layer) is that kind's."""
    parts = {}
    for i, segment in enumerate(layer_segments(cfg)):
        kinds = {part_name(kind) for kind in segment.pattern}
        if len(kinds) == 1:
            parts[f"segment_{i}"] = kinds.pop()
    return parts


def part_of(op_name: str | None, segments: dict[str, str]) -> str:
    """The part an op's time goes to, from its scope: a layer kind, `outside_layers`, or `unattributed` (no
    metadata, or the scan of a segment of several kinds)."""
    if op_name is None:
        return UNATTRIBUTED
    kind, segment = KIND_SCOPE.search(op_name), SEGMENT_SCOPE.search(op_name)
    if kind:
        return kind.group(1)
    return segments.get(segment.group(1), UNATTRIBUTED) if segment else OUTSIDE


def summarize_trace(
    trace: dict, hlo_text: str, steps: int, on_cpu: bool, segments: dict[str, str] | None = None
) -> dict:
    """Per step: kernel count and time, the TOP_KERNELS most expensive kernels with their share, device-to-host
    copies, and the kernel time of each part (`part_seconds`; `segments`: see segment_parts)."""
    module, scopes = hlo_scopes(hlo_text)
    kernels, copies, source = step_events(trace, on_cpu)
    kernels = of_module(kernels, module)
    if not kernels:
        raise ValueError(f"the trace shows no kernels ({source})")
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    parts: dict[str, float] = defaultdict(float)
    scope_of_name: dict[str, str] = {}
    for event, seconds in exclusive_seconds(kernels):
        op = event.get("args", {}).get("hlo_op") or event["name"]
        op_name = scopes.get(op) or scopes.get(re.sub(r"[.\-]", "_", op))
        parts[part_of(op_name, segments or {})] += seconds
        by_name[event["name"]][0] += seconds
        by_name[event["name"]][1] += 1
        if op_name is not None:
            scope_of_name.setdefault(event["name"], short_scope(op_name))
    total = sum(seconds for seconds, _ in by_name.values())
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    copy_counts: dict[str, float] = defaultdict(float)
    for e in copies or []:
        copy_counts[e["name"]] += 1 / steps
    return {
        "source": source,
        "steps": steps,
        "kernel_count_per_step": len(kernels) / steps,
        "kernel_seconds_per_step": total / steps,
        "top_kernels": [
            {
                "name": name,
                "scope": scope_of_name.get(name, ""),
                "seconds_per_step": s / steps,
                "share": s / total if total else 0.0,
                "calls_per_step": n / steps,
            }
            for name, (s, n) in top
        ],
        "d2h_copies_per_step": None
        if copies is None
        else sum(n for name, n in copy_counts.items() if D2H_NAME.search(name)),
        "copies_per_step": dict(copy_counts),
        "part_seconds_per_step": {part: s / steps for part, s in parts.items()},
    }


def profile_steps(runner: ModelRunner, batch: StepBatch, steps: int, hlo_text: str) -> dict:
    """`steps` decode steps through `runner.run` (the serving path) under jax.profiler.trace, summarized; the reason
    instead when there is no trace to read."""
    # The Perfetto JSON's events name their HLO op; a jax without the option still writes the trace viewer's.
    perfetto = {"create_perfetto_trace": True} if "create_perfetto_trace" in PROFILER_OPTIONS else {}
    try:
        with tempfile.TemporaryDirectory() as folder:
            with jax.profiler.trace(folder, **perfetto):
                for _ in range(steps):
                    runner.run(batch)
            return summarize_trace(
                load_trace(folder),
                hlo_text,
                steps,
                runner.mesh.devices.flat[0].platform == "cpu",
                segment_parts(runner.cfg),
            )
    except Exception as error:  # noqa: BLE001 - a profile that cannot be read is a result, not a crash
        return {"error": f"{type(error).__name__}: {error}"}


# ---- measurements -------------------------------------------------------------------------------------------------


def part_rows(
    choice: str,
    batch: int,
    step_s: float,
    profile: dict,
    costs: list[LayerCost],
    cfg: ModelConfig,
    context: int,
    bandwidth: float,
) -> list[dict]:
    """Rows per layer kind (and outside the layers): the step's time split by the kinds' shares of the traced
    kernel time, per layer, against one layer's bytes."""
    if "error" in profile:
        return []
    seconds = profile["part_seconds_per_step"]
    kernel_total = sum(seconds.values())
    if kernel_total <= 0:
        return []
    layers: dict[str, list[LayerCost]] = defaultdict(list)
    for cost in costs:
        layers[cost.part].append(cost)
    rows = []
    for part in [*layers, OUTSIDE]:  # model order; unattributed time has no row (its share is on the step's)
        part_s = seconds.get(part, 0.0)
        if part == OUTSIDE:
            count, counted = 1, outside_bytes(cfg, batch)
        else:
            count, counted = len(layers[part]), layer_bytes(layers[part][0], cfg, batch, context)
        step = step_s * part_s / kernel_total / count
        read = sum(counted.values())
        rows.append(
            {
                "part": part,
                "batch": batch,
                "implementation": choice,
                "layers": count,
                "step_s": step,
                "kernel_s": part_s / count,
                "bytes": read,
                "bound_s": read / bandwidth,
                "fraction_of_bound": (read / bandwidth) / step if step > 0 else None,
                "method": "share of the traced kernel time",
            }
        )
    return rows


def measure_decode(
    runner: ModelRunner, choice: str, plan: Plan, costs: list[LayerCost], cfg: ModelConfig, bandwidth: float
) -> tuple[list[dict], dict[int, dict]]:
    rows, profiles = [], {}
    for batch in plan.batches:
        step = decode_rows(runner.geometry, batch, plan.context)
        runner.device_seconds(step, 1)  # untimed: after it every row feeds its own sampled token
        pace = statistics.median(runner.device_seconds(step, plan.repeats, back_to_back=plan.back_to_back))
        latency = statistics.median(runner.device_seconds(step, plan.repeats))
        read = decode_bytes(costs, cfg, batch, plan.context)
        total = sum(read.values())
        rows.append(
            {
                "part": "layer_step",
                "batch": batch,
                "implementation": choice,
                "layers": cfg.num_layers,
                "step_s": pace,
                "latency_s": latency,
                "bytes": total,
                "bound_s": total / bandwidth,
                "fraction_of_bound": (total / bandwidth) / pace,
                "method": "device_seconds",
                **static_estimate(runner, StepShape(decode=GroupShape(batch, 1)), bandwidth),
            }
        )
        profile = profiles[batch] = profile_steps(
            runner, step, plan.trace_steps, compiled_text(runner, StepShape(decode=GroupShape(batch, 1)))
        )
        if "error" in profile:
            rows[-1]["profile_error"] = profile["error"]
        else:  # kernel time the HLO metadata could not place in a part (the part rows leave it out)
            parts = profile["part_seconds_per_step"]
            rows[-1]["unattributed_share"] = parts.get(UNATTRIBUTED, 0.0) / sum(parts.values())
        rows += part_rows(choice, batch, pace, profile, costs, cfg, plan.context, bandwidth)
        log(f"{choice} decode batch {batch}: {1e3 * pace:.3f} ms, bound {1e3 * total / bandwidth:.3f} ms")
    return rows, profiles


def measure_prefill(
    runner: ModelRunner,
    choice: str,
    plan: Plan,
    costs: list[LayerCost],
    cfg: ModelConfig,
    peak: float,
    bandwidth: float,
) -> dict:
    chunk = prefill_chunk(runner.geometry, cfg, plan)
    start = plan.context - plan.chunk
    seconds = statistics.median(runner.device_seconds(chunk, plan.repeats))
    flops = prefill_flops(costs, cfg, start, plan.chunk)
    bound = flops["total"] / peak
    log(f"{choice} prefill {plan.chunk} tokens: {1e3 * seconds:.3f} ms, bound {1e3 * bound:.3f} ms")
    return {
        "implementation": choice,
        "tokens": plan.chunk,
        "start": start,
        "step_s": seconds,
        "flops": flops,
        "bound_s": bound,
        "fraction_of_peak": bound / seconds,
        **static_estimate(runner, StepShape(prefill=GroupShape(1, plan.chunk)), bandwidth),
    }


def compile_all(runner: ModelRunner) -> None:
    """Every step shape of `runner`, compiled at once on the host's cores (one after another they took most of the
    time budget)."""
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        for job in [pool.submit(runner.warmup, [shape]) for shape in runner.buckets.shapes()]:
            job.result()


def measure_implementation(
    choice: str, cfg: ModelConfig, weights, mesh, plan: Plan, costs: list[LayerCost], args: argparse.Namespace
) -> dict:
    """One kernel choice: its runner over the shared weights, compiled, then its decode rows, profiles and prefill."""
    buckets = Buckets(prefill_rows=(1,), prefill_chunks=(plan.chunk,), decode_rows=plan.batches)
    runner = ModelRunner(cfg, weights, geometry_for(cfg, plan), mesh, buckets, kernels=choice)
    started = time.perf_counter()
    compile_all(runner)
    compile_s = {"wall": time.perf_counter() - started, **{str(k): v for k, v in runner.times.compile_s.items()}}
    log(f"{choice}: compiled {len(buckets.shapes())} step shapes in {compile_s['wall']:.1f} s")
    rows, profiles = measure_decode(runner, choice, plan, costs, cfg, args.bandwidth)
    prefill = measure_prefill(runner, choice, plan, costs, cfg, args.peak_bf16, args.bandwidth)
    return {"rows": rows, "profiles": profiles, "prefill": prefill, "compile_s": compile_s}


# ---- the tiny default model, in a child process -------------------------------------------------------------------


def tiny_decode_period(choice: str, plan: Plan) -> dict:
    """The embedded default (float32, as benchmarks/async_loop.py loads it) at batch 1: the engine loop's median
    decode period, the compiled step's device time back to back and alone, and the host's share."""
    mesh = make_mesh(1, 1)
    loaded = load_model(None, mesh, dtype="float32")
    cfg = EngineConfig(
        dtype="float32",
        max_num_seqs=1,
        chunked_prefill_size=16,
        max_prefill_rows=1,
        page_size=16,
        max_model_len=256,
        decode_log_interval=10**9,
        kernels=choice,
    )
    runner = build_runner(cfg, loaded.config, loaded.weights, mesh)
    compile_all(runner)
    engine = Engine(cfg, loaded.config, runner, loaded.tokenizer.eos_ids)
    handle = engine.submit(
        [5, 6, 7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=plan.tiny_tokens, temperature=0.0, ignore_eos=True)
    )
    engine.start()
    try:
        handle.wait(timeout=CHILD_TIMEOUT_S)
    finally:
        engine.shutdown()
    ends = [r.ended for r in engine.step_record if r.kind is StepKind.DECODE]
    period = statistics.median(b - a for a, b in zip(ends, ends[1:]))
    row = StepBatch.of(
        StepPlan.decode_of(
            [
                Request(
                    "tiny",
                    [5, 6, 7, 8],
                    SamplingParams(temperature=0.0),
                    slot=0,
                    num_sampled=1,
                    pages=slot_pages(runner.geometry, 0),
                )
            ]
        )
    )
    device = statistics.median(runner.device_seconds(row, plan.tiny_repeats, back_to_back=8))
    latency = statistics.median(runner.device_seconds(row, plan.tiny_repeats))
    first = jax.devices()[0]
    return {
        "platform": first.platform,
        "device_kind": first.device_kind,
        "kernels": runner.kernels.describe(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "decode_steps": len(ends),
        "period_s": period,
        "device_s": device,
        "device_latency_s": latency,
        "host_s": period - device,
        "host_share": (period - device) / period,
    }


def run_tiny_child(choice: str, plan: Plan, extra_flags: str = "") -> tuple[dict, str]:
    """tiny_decode_period in a fresh process (XLA reads its flags once per process), with `extra_flags` appended
    to XLA_FLAGS; (its result or {"error": ...}, the command)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # never starve a GPU this process holds
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {extra_flags}".strip()
    argv = [sys.executable, str(Path(__file__).resolve()), "--tiny-child", "--kernels", choice]
    argv += ["--cpu-smoke"] if plan.smoke else []
    command = f"XLA_FLAGS={shlex.quote(env['XLA_FLAGS'])} {shlex.join(argv)}"
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}, command
    marked = [line[len(CHILD_MARK) :] for line in done.stdout.splitlines() if line.startswith(CHILD_MARK)]
    if done.returncode != 0 or not marked:
        return {"error": f"exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}"}, command
    return json.loads(marked[-1]), command


def tiny_runs(choice: str, plan: Plan) -> tuple[dict, Any, list[str]]:
    """(the default-flags run, the command-buffer comparison or why there is none, the commands)."""
    default, command = run_tiny_child(choice, plan)
    commands = [command]
    log(f"tiny model, default XLA flags: {default.get('period_s', default.get('error'))}")
    if "error" in default:
        return default, "not measured: the default-flags run failed", commands
    if default["platform"] != "gpu":
        return default, "skipped: not a GPU", commands
    extended, command = run_tiny_child(choice, plan, COMMAND_BUFFER_FLAG)
    commands.append(command)
    if "error" in extended:
        return default, {"flag": COMMAND_BUFFER_FLAG, "default": default, "error": extended["error"]}, commands
    return (
        default,
        {
            "flag": COMMAND_BUFFER_FLAG,
            "default": default,
            "extended": extended,
            "device_s_ratio": extended["device_s"] / default["device_s"],
            "period_s_ratio": extended["period_s"] / default["period_s"],
        },
        commands,
    )


# ---- the report ---------------------------------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.3f}"


def fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(report: dict) -> str:
    device, settings = report["device"], report["settings"]
    header = [
        f"# Flash layers against their rooflines on {device['device_kind']} ({device['platform']})",
        "",
        f"`{report['commands']['run']}`",
        "",
        f"jax {report['jax']}; {settings['layers']} layers ({', '.join(report['model']['parts'])}), context "
        f"{settings['context']}, FP8 projections, FP4 experts, FP8 KV, TP 1; bandwidth "
        f"{settings['bandwidth']:.3g} B/s, bf16 peak {settings['peak_bf16']:.3g} FLOP/s."
        + ("" if report["complete"] else " **Incomplete: the run stopped early.**"),
    ]
    sections = [
        header,
        md_decode(report),
        md_prefill(report),
        md_tiny(report["tiny_decode"]),
        md_profiles(report["profile"]),
        md_command_buffers(report["command_buffers"]),
        [
            "## How the bounds are counted",
            "",
            report["bytes_counted"]["method"],
            "",
            report["flops_counted"],
            "",
            "## How the decode step is set up",
            "",
            report["setup"],
            "",
            "## Kernels",
            "",
        ]
        + [f"- {choice}: {described}" for choice, described in report["kernels"].items()],
    ]
    if report["errors"]:
        sections.append(
            ["## Errors", ""]
            + [f"- {choice}: `{error.strip().splitlines()[-1]}`" for choice, error in report["errors"].items()]
        )
    return "\n\n".join("\n".join(section) for section in sections) + "\n"


def md_decode(report: dict) -> list[str]:
    rows = [
        [
            r["part"],
            r["batch"],
            r["implementation"],
            r["layers"],
            ms(r["step_s"]),
            ms(r.get("latency_s")),
            ms(r.get("kernel_s")),
            ms(r.get("static_estimate_s")),
            ms(r["bound_s"]),
            fraction(r["fraction_of_bound"]),
            f"{r['bytes'] / 1e6:,.2f}",
        ]
        for r in report["decode"]
    ]
    return [
        "## Decode step against the HBM bound",
        "",
        markdown_table(
            [
                "part",
                "batch",
                "implementation",
                "layers",
                "step ms",
                "latency ms",
                "kernel ms",
                "static estimate ms",
                "bound ms",
                "fraction of bound",
                "bytes read (MB)",
            ],
            rows,
        ),
        "",
        "layer_step: the whole step; the other parts: per layer of that kind (outside_layers: once per step). "
        "static estimate: what benchmarks/gpu_static.py's model says of the same step (XLA's cost model and the "
        "kernels' bytes, from this compile's HLO), beside the measurement so the model's error shows.",
    ]


def md_prefill(report: dict) -> list[str]:
    rows = [
        [
            p["implementation"],
            p["tokens"],
            p["start"],
            ms(p["step_s"]),
            ms(p.get("static_estimate_s")),
            f"{p['flops']['total'] / 1e12:.4f}",
            ms(p["bound_s"]),
            fraction(p["fraction_of_peak"]),
        ]
        for p in report["prefill"]
    ]
    return [
        "## Prefill chunk against the bf16 compute bound",
        "",
        markdown_table(
            [
                "implementation",
                "tokens",
                "first position",
                "step ms",
                "static estimate ms",
                "TFLOP",
                "bound ms",
                "fraction of peak",
            ],
            rows,
        ),
    ]


def md_tiny(tiny: dict) -> list[str]:
    lines = ["## Tiny default model, decode period at batch 1", ""]
    if "error" in tiny:
        return lines + [f"Not measured: {tiny['error']}"]
    return lines + [
        f"Kernels: {tiny['kernels']}.",
        "",
        markdown_table(
            ["loop period ms", "device ms (back to back)", "device ms (alone)", "host ms", "host share"],
            [
                [
                    ms(tiny["period_s"]),
                    ms(tiny["device_s"]),
                    ms(tiny["device_latency_s"]),
                    ms(tiny["host_s"]),
                    f"{tiny['host_share']:.1%}",
                ]
            ],
        ),
    ]


def md_profiles(profiles: dict) -> list[str]:
    lines = [f"## Profile of the batch-{PROFILE_BATCH} decode step"]
    for choice, profile in profiles.items():
        lines += ["", f"### {choice}", ""]
        if "error" in profile:
            lines.append(f"No profile: {profile['error']}")
            continue
        d2h = profile["d2h_copies_per_step"]
        copies = json.dumps(profile["copies_per_step"])
        copies = f" (all copies per step: {copies})" if profile["copies_per_step"] else ""
        lines += [
            f"{profile['source']}; {profile['steps']} steps. Kernels per step: "
            f"{profile['kernel_count_per_step']:.1f}; kernel time per step: "
            f"{ms(profile['kernel_seconds_per_step'])} ms; device-to-host copies per step: "
            f"{'n/a' if d2h is None else f'{d2h:.1f}'}{copies}.",
            "",
            markdown_table(
                ["kernel", "scope", "ms per step", "share", "calls per step"],
                [
                    [
                        k["name"][:80],
                        k["scope"],
                        ms(k["seconds_per_step"]),
                        f"{k['share']:.1%}",
                        f"{k['calls_per_step']:.1f}",
                    ]
                    for k in profile["top_kernels"]
                ],
            ),
        ]
    return lines


def md_command_buffers(buffers: Any) -> list[str]:
    lines = ["## XLA command buffers extended to while loops and conditionals", ""]
    if isinstance(buffers, str):
        return lines + [buffers[0].upper() + buffers[1:] + "."]
    if "error" in buffers:
        return lines + [f"`{buffers['flag']}`: the run failed: {buffers['error']}"]
    runs = [
        [name, ms(run["period_s"]), ms(run["device_s"]), ms(run["device_latency_s"]), ms(run["host_s"])]
        for name, run in (("defaults", buffers["default"]), ("extended", buffers["extended"]))
    ]
    return lines + [
        f"`{buffers['flag']}` against the defaults, tiny model, batch 1:",
        "",
        markdown_table(
            ["XLA flags", "loop period ms", "device ms (back to back)", "device ms (alone)", "host ms"], runs
        ),
        "",
        f"Device time, extended / defaults: {buffers['device_s_ratio']:.3f}; loop period: "
        f"{buffers['period_s_ratio']:.3f}.",
    ]


def save(report: dict, out: Path, smoke: bool) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_roofline_cpu_smoke" if smoke else "gpu_roofline"
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(report))
    return out / f"{name}.json"


# ---- main ---------------------------------------------------------------------------------------------------------


def describe_kernels(choice: str, platform: str) -> str:
    try:
        return kernels_for(choice, platform).describe()
    except Exception as error:  # noqa: BLE001 - e.g. Pallas failing to import; the runner's error says more
        return f"unavailable: {type(error).__name__}: {error}"


def kernel_choices(values: list[str] | None) -> list[str]:
    chosen = [c.strip() for v in (values or ["reference,pallas"]) for c in v.split(",") if c.strip()]
    bad = [c for c in chosen if c not in KERNEL_CHOICES]
    if bad:
        raise SystemExit(f"--kernels {bad}: choose from {KERNEL_CHOICES}")
    return list(dict.fromkeys(chosen))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", action="append", help="kernel table choice(s): repeat or comma-separate")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="device memory bytes/s (H200: 4.8e12)")
    parser.add_argument("--peak-bf16", type=float, default=989e12, help="dense bf16 FLOP/s (H200: 989e12)")
    parser.add_argument("--layers", type=int, default=4, help="Flash's first N layers (4: SWA, SWA, CSA, HCA)")
    parser.add_argument("--context", type=int, default=None, help="decode position (default 4096; smoke 128)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: checks the script")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and markdown")
    parser.add_argument("--tiny-child", action="store_true", help=argparse.SUPPRESS)  # run_tiny_child's process
    args = parser.parse_args(argv)
    args.kernels = kernel_choices(args.kernels)
    return args


def configure(plan: Plan) -> None:
    """XLA flags and the persistent compile cache, before anything touches a device."""
    ask_for_cost_model()  # the static estimate beside each measured row reads the cost model's times
    if plan.smoke:  # on CPU unless JAX_PLATFORMS says otherwise (tiny shapes on a GPU: a quick first check there)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        add_xla_flags(*CHEAP_CPU_COMPILE_FLAGS)  # its timings mean nothing (a child inherits them)
    jax.config.update("jax_compilation_cache_dir", str(COMPILE_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def new_report(
    args: argparse.Namespace,
    plan: Plan,
    cfg: ModelConfig,
    costs: list[LayerCost],
    first,
    tiny: dict,
    command_buffers: Any,
    child_commands: list[str],
) -> dict[str, Any]:
    """The report before any Flash measurement: the device, the settings, what the bounds count, the tiny runs."""
    return {
        "device": {"device_kind": first.device_kind, "platform": first.platform, "count": len(jax.devices())},
        "jax": jax.__version__,
        "complete": False,
        "commands": {"run": shlex.join([sys.executable, *sys.argv]), "tiny_children": child_commands},
        "settings": {
            **dataclasses.asdict(plan),
            "bandwidth": args.bandwidth,
            "peak_bf16": args.peak_bf16,
            "kernels": args.kernels,
            "kv_cache_dtype": "fp8",
            "tensor_parallel": 1,
        },
        "model": {
            "layer_kinds": list(cfg.layer_kinds),
            "hash_layers": list(cfg.hash_layers),
            "parts": [c.part for c in costs],
            "dtype": cfg.dtype,
            "linear_format": cfg.linear_format,
            "expert_format": cfg.expert_format,
        },
        "kernels": {choice: describe_kernels(choice, first.platform) for choice in args.kernels},
        "decode": [],
        "prefill": [],
        "prefill_fraction_of_peak": {},
        "profile": {},
        "compile_s": {},
        "errors": {},
        "tiny_decode": tiny,
        "tiny_decode_period_s": tiny.get("period_s"),
        "command_buffers": command_buffers,
        "bytes_counted": {
            "method": inspect.cleandoc(decode_bytes.__doc__),
            "bandwidth": args.bandwidth,
            "per_batch": {str(b): decode_bytes(costs, cfg, b, plan.context) for b in plan.batches},
        },
        "flops_counted": inspect.cleandoc(prefill_flops.__doc__),
        "setup": SETUP,
    }


def run_flash(report: dict, args: argparse.Namespace, plan: Plan, cfg: ModelConfig, costs: list[LayerCost]) -> None:
    """Each implementation in turn (compiled, measured, its runner dropped) into `report`, saved after each: what
    one implementation measured survives another's failing, even a hang, which only the time limit ends."""
    mesh = make_mesh(1, 1)
    log(f"{report['device']['device_kind']}: drawing {cfg.num_layers} layers' weights")
    weights = random_weights(cfg, mesh)
    for choice in args.kernels:
        try:
            measured = measure_implementation(choice, cfg, weights, mesh, plan, costs, args)
        except Exception:  # noqa: BLE001 - one implementation failing (e.g. a kernel that does not compile) is a result
            report["errors"][choice] = traceback.format_exc()[-3000:]
            log(f"{choice} failed:\n{report['errors'][choice]}")
        else:
            report["decode"] += measured["rows"]
            report["prefill"].append(measured["prefill"])
            report["prefill_fraction_of_peak"][choice] = measured["prefill"]["fraction_of_peak"]
            report["profile"][choice] = measured["profiles"].get(PROFILE_BATCH, {"error": "batch not measured"})
            report["compile_s"][choice] = measured["compile_s"]
        gc.collect()  # this runner's cache and executables go before the next one's
        save(report, args.out, plan.smoke)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    configure(plan)
    if args.tiny_child:
        print(CHILD_MARK + json.dumps(tiny_decode_period(args.kernels[0], plan)), flush=True)
        return 0
    # The children first: until this process initializes its backend they have the whole device to themselves.
    tiny, command_buffers, child_commands = tiny_runs(args.kernels[0], plan)
    first = jax.devices()[0]
    if first.platform == "cpu" and not plan.smoke:
        raise SystemExit("no accelerator: Flash-sized layers need one; use --cpu-smoke for a dry run on CPU")
    cfg = model_config(plan)
    costs = layer_costs(cfg, geometry_for(cfg, plan))
    report = new_report(args, plan, cfg, costs, first, tiny, command_buffers, child_commands)
    save(report, args.out, plan.smoke)
    run_flash(report, args, plan, cfg, costs)
    report["complete"] = True
    log(f"wrote {save(report, args.out, plan.smoke)} and its markdown")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
