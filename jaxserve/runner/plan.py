"""Will a model fit these devices, and how much KV cache is left? Answered without allocating anything.

Per device: the weights' bytes from their abstract description and shardings (each leaf's shard shape; quantized
weights as codes plus scales), the step temporaries from XLA's memory analysis of the compiled decode step and the
largest prefill step (on abstract weights and cache, so fake CPU devices will do), the per-sequence state (window
rings, compressor state) of max_num_seqs slots, and what remains for the paged KV pools: tokens that fit, and
requests of max_model_len that fit at once. The KV sizes follow kv_cache_dtype.

For a GPU target (`make_plan(..., target="h200")`, `jaxserve plan --target`: jaxserve.runner.targets), the mesh is
one of deviceless GPU devices and every step shape of the buckets is compiled as the engine compiles it, by XLA's
GPU pipeline (Pallas kernels through Triton): the temporaries are the largest of those compiles', and the largest
decode step is profiled statically (jaxserve.runner.hlo_profile) against the least it must read (decode_read_bytes).
"""

from __future__ import annotations

import os
import re
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr
from jax.sharding import Mesh
from jaxlib import xla_client

import jaxserve.kernels
from jaxserve.config import CSA, ConfigError, EngineConfig, ModelConfig, check_memory_fraction
from jaxserve.kernels.quant import Quantized
from jaxserve.model.cache import CacheGeometry, bytes_per_token, entry_bytes, kv_geometry, resolve_max_model_len
from jaxserve.model.sharding import ShardingError, for_mesh, make_mesh, shape_dtype_structs, shardings_for
from jaxserve.model.weights import (
    HOST_MEMORY,
    abstract_weights,
    flatten_with_names,
    is_info,
    is_quantized,
    is_weight,
    nbytes,
)
from jaxserve.request.step import GroupShape, StepShape
from jaxserve.runner import Buckets, targets
from jaxserve.runner.executables import ExecutableCache
from jaxserve.runner.hlo_profile import step_profile
from jaxserve.runner.model_runner import step_kernels
from jaxserve.runner.speculative import abstract_runner_cache
from jaxserve.runner.targets import GpuTarget

GB = 1e9
# XLA:CPU computes bf16 dots in f32, and loop-invariant code motion hoists the weights' conversion out of the
# layer scan: a full f32 copy of every stacked weight (temporaries 2x the bf16 weights) that a device with native
# bf16 / fp8 dots never makes. Left in the loop, each layer's conversion is a one-layer temporary.
ACCELERATOR_LIKE: dict[str, str | bool] = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
# jaxlib reads the share of a GPU its allocator takes from these when the GPU backend starts (xla_client's
# generate_pjrt_gpu_plugin_options), the older name only when the newer is unset (both set is an error there).
MEMORY_FRACTION_ENV = "XLA_CLIENT_MEM_FRACTION"
LEGACY_MEMORY_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_MEMORY_FRACTION = 0.75  # what JAX's allocator takes when neither says otherwise


@dataclass
class StepCompile:
    """One step shape compiled for a GPU target."""

    shape: str
    temp_bytes: int  # XLA's temporaries per device: the forward's plus its larger sampler's (verify: larger variant)
    compile_s: float


@dataclass
class DecodeEstimate:
    """The largest decode step on a GPU target: its static profile (model figures from the optimized HLO, nothing
    run) against the least one device must read in it (decode_read_bytes), the HBM bound."""

    shape: str
    rows: int
    context: int  # the position the bound's KV read is counted at: max_model_len, what the page tables cover
    launches: int  # kernel launches of the forward and its sampler (a verify step: the whole step), loops unrolled
    bytes: float  # what those kernels read and write, as hlo_profile counts them
    model_s: float  # XLA's cost-model time of the kernels it prices (0: compiled without COST_MODEL_FLAG)
    estimate_s: float  # StaticProfile.estimate at the target's bandwidth
    bound_bytes: int  # decode_read_bytes: a lower bound
    bound_s: float  # bound_bytes / the target's bandwidth


# Plan's fields that only a GPU target fills; without one its JSON leaves them out (as before targets existed).
TARGET_FIELDS = ("target", "kernels", "steps", "decode_estimate")


@dataclass
class Plan:
    devices: int
    device_memory: int  # bytes of one device that the model, its temporaries and the KV cache may take
    weights_bytes_per_device: int
    weights_bytes_by_format: dict[str, int]  # per device: fp8_e4m3 / fp4_e2m1 codes, their scales, dense dtypes
    weights_bytes_total: int  # the model once, unsharded
    temp_bytes_per_device: int | None  # None: not compiled (the weights alone do not fit)
    state_bytes_per_device: int  # per-sequence state of max_num_seqs slots (window rings, compressor state)
    kv_bytes_per_token: float
    max_kv_tokens: int
    max_model_len: int
    max_num_seqs: int
    max_concurrent_requests: int
    fits: bool
    reason: str
    compile_s: float = 0.0
    compiled_steps: list[str] = field(default_factory=list)
    target: str | None = None  # the GPU the steps were compiled for (jaxserve.runner.targets); None: CPU devices
    # --disaggregation-mode: a prefill server's steps are prefill steps only (its KV holds prompts until they are
    # handed off), a decode server's decode steps only (its KV holds every request it streams); null: both
    disaggregation_mode: str = "null"
    kernels: str | None = None  # a target's implementations of the kernel-worthy operations (Kernels.describe)
    steps: list[StepCompile] = field(default_factory=list)  # a target's: every step shape of the buckets
    decode_estimate: DecodeEstimate | None = None

    def to_json(self) -> dict:
        report = asdict(self)
        if self.target is None:
            for key in TARGET_FIELDS:
                del report[key]
        return report


class StepCompileError(RuntimeError):
    """A step shape failed to compile for a GPU target (a Pallas kernel's lowering, Triton, ptxas or XLA): which
    shape, where (kernel_scope), and the compiler's message."""

    def __init__(self, shape: StepShape, gpu: str, failed: BaseException):
        self.shape, self.scope = shape, kernel_scope(failed)
        lines = str(failed).strip().splitlines() or [""]
        message = "\n".join(lines[:ERROR_LINES]) + (
            f"\n... ({len(lines) - ERROR_LINES} more lines)" if len(lines) > ERROR_LINES else ""
        )
        where = f" in {self.scope}" if self.scope else ""
        super().__init__(f"compiling step {shape} for {gpu} failed{where}: {type(failed).__name__}: {message}")


ERROR_LINES = 20  # of a compiler's message (XLA's may carry a whole HLO module)
_KERNELS_DIR = Path(jaxserve.kernels.__file__).resolve().parent
_MODEL_DIR = Path(__file__).resolve().parents[1] / "model"
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_PALLAS_NAME = re.compile(r"pallas_call\b[^\n]*?\bname=\"?([\w.\-]+)")


def kernel_scope(failed: BaseException) -> str | None:
    """Where a compile failed, when it says: the named scope of the HLO instruction its message quotes (`op_name`),
    the Pallas call it names, else the innermost frame of jaxserve's kernels (else its model) in the traceback, or
    in the trace of the operation that failed to lower, which JAX attaches as the cause."""
    text = str(failed)
    found = _OP_NAME.search(text) or _PALLAS_NAME.search(text)
    if found:
        return found.group(1)
    frames: list[traceback.FrameSummary] = []
    seen: set[int] = set()
    error: BaseException | None = failed
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frames += traceback.extract_tb(error.__traceback__)
        error = error.__cause__ or error.__context__
    for folder in (_KERNELS_DIR, _MODEL_DIR):
        inside = [f for f in frames if Path(f.filename).resolve().is_relative_to(folder)]
        if inside:
            frame = inside[-1]
            return f"{folder.name}/{Path(frame.filename).resolve().relative_to(folder)}:{frame.lineno} ({frame.name})"
    return None


def memory_share(gpu_memory_utilization: float | None = None) -> tuple[float, str]:
    """(the share of a device the serving process may allocate, where it comes from): --gpu-memory-utilization,
    else what JAX's allocator is told ($XLA_CLIENT_MEM_FRACTION, else $XLA_PYTHON_CLIENT_MEM_FRACTION), else JAX's
    default 0.75; the rest is left to the runtime and others."""
    if gpu_memory_utilization is not None:
        return check_memory_fraction(gpu_memory_utilization, "gpu_memory_utilization"), "--gpu-memory-utilization"
    for name in (MEMORY_FRACTION_ENV, LEGACY_MEMORY_FRACTION_ENV):
        raw = os.environ.get(name)
        if raw:
            try:
                value = float(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r}: must be a number in (0, 1]") from None
            return check_memory_fraction(value, name), f"${name}"
    return JAX_MEMORY_FRACTION, "JAX's default"


def usable_memory(device_memory: int, gpu_memory_utilization: float | None = None) -> int:
    """The bytes of a device of `device_memory` that the serving process may allocate (memory_share)."""
    return int(device_memory * memory_share(gpu_memory_utilization)[0])


def give_the_allocator(gpu_memory_utilization: float | None) -> None:
    """Tell JAX's GPU allocator --gpu-memory-utilization, if set, so it takes that share and reports it as its limit
    (which the fit check then reads). Effective only before JAX starts its backends (jaxlib reads the variable when
    it creates the GPU client); the flag replaces both variables' values. CPUs ignore it."""
    if gpu_memory_utilization is None:
        return
    os.environ.pop(LEGACY_MEMORY_FRACTION_ENV, None)
    os.environ[MEMORY_FRACTION_ENV] = str(memory_share(gpu_memory_utilization)[0])


_COMPILE_ONLY_CPUS: dict[int, list] = {}


def plan_devices(count: int) -> list:
    """`count` CPU devices to compile a plan's steps on: the process's own (fake, from
    --xla_force_host_platform_device_count) when it has that many, else those of a second CPU client of `count`
    devices made for the plan (cached per count), whose devices only ever compile: nothing is placed on them. So a
    plan for more devices than the process started with (several nodes) needs no restart."""
    own = jax.devices("cpu")
    if count <= len(own):
        return own[:count]
    if count not in _COMPILE_ONLY_CPUS:
        client: Any = xla_client.make_cpu_client(num_devices=count)  # jaxlib's stubs leave its type unresolved
        _COMPILE_ONLY_CPUS[count] = list(client.devices())
    return _COMPILE_ONLY_CPUS[count]


def _stored_arrays(cfg: ModelConfig, mesh: Mesh) -> Iterator[tuple[str, str, Any, int, int]]:
    """(weight name, storage format, its array's info, its bytes on one device, its bytes whole) of every array the
    weights `cfg` describes are stored as (a quantized weight: its codes and its scales), sharded over `mesh`
    (ShardingError when they cannot be), the vocabulary padded as `mesh` holds it."""
    abstract = abstract_weights(for_mesh(cfg, mesh))
    shardings = shardings_for(abstract, mesh)
    weights = flatten_with_names(abstract, is_weight)
    for (name, weight), (_, sharding) in zip(weights, flatten_with_names(shardings, is_quantized)):
        parts = (
            [("codes", weight.codes, sharding.codes), ("scales", weight.scales, sharding.scales)]
            if isinstance(weight, Quantized)
            else [(None, weight, sharding)]
        )
        for part, info, part_sharding in parts:
            kind = jnp.dtype(info.dtype).name if part is None else (weight.format if part == "codes" else "scales")
            yield name, kind, info, nbytes(info, part_sharding.shard_shape(info.shape)), nbytes(info)


def weight_bytes(cfg: ModelConfig, mesh: Mesh) -> tuple[int, dict[str, int], int]:
    """(bytes per device, the same by storage format, bytes of the whole model) of the weights `cfg` describes,
    sharded over `mesh` (ShardingError when it cannot be), its vocabulary padded as `mesh` holds it. What lives in
    the host's memory (Engram tables placed there) is not in a device's bytes; `by format` has it per device's share,
    as "<format> in host memory"."""
    by_format: dict[str, int] = {}
    total = on_devices = 0
    for _, kind, info, per_device, whole in _stored_arrays(cfg, mesh):
        if info.memory == HOST_MEMORY:  # DeepSeek-V4.1's Engram tables with --engram-placement host
            kind = f"{kind} in host memory"
        else:
            on_devices += per_device
        by_format[kind] = by_format.get(kind, 0) + per_device
        total += whole
    return on_devices, by_format, total


def decode_read_bytes(
    cfg: ModelConfig, mesh: Mesh, rows: int, context: int, kv_cache_dtype: str = "auto", tokens_per_row: int = 1
) -> int:
    """A lower bound on the bytes one device of `mesh` must read in a decode step of `rows` rows at position
    `context`, each of `tokens_per_row` tokens (a verify step's: its drafts + 1), each array at its storage size (FP8 /
    FP4 codes plus scales, the KV cache as kv_cache_dtype stores it):
    - the weights it holds (the MTP block's too, when `cfg` has one), read once whatever the rows, except the routed
      experts, of which only min(n_routed_experts, tokens x num_experts_per_tok) of every n_routed_experts (the most
      the step's tokens can pick; spread over the devices that hold experts, the average share, which the busiest
      device reads at least), and the embedding and hash-routing tables, of which a step reads one row per token (not
      counted);
    - per row, the compressed KV (bytes_per_token; every device holds every token's entries) of min(context,
      index_topk x csa_rate) tokens: a CSA layer's attention reads every entry while there are at most index_topk,
      and the indexer keys and HCA entries are read whatever the context.
    Not counted: the window rings and compressor state, activations, anything written. So a decode step takes at
    least this over the HBM bandwidth."""
    cfg = for_mesh(cfg, mesh)
    experts = min(cfg.n_routed_experts, rows * tokens_per_row * cfg.num_experts_per_tok)
    weights = 0.0
    for name, _, info, per_device, _ in _stored_arrays(cfg, mesh):
        if name == "embed" or name.endswith("tid2eid") or "engram_rows" in info.axes:  # a row per token is read
            continue
        weights += per_device * experts / cfg.n_routed_experts if "experts" in info.axes else per_device
    if cfg.shared_kv is not None:  # DeepSeek-V4.1: per KV source, every indexer key and the picked entries
        kv = cfg.shared_kv
        entry, key = (entry_bytes(cfg, kv_cache_dtype, index) for index in (False, True))
        per_row = sum(
            (context // kv.ratios[s]) * key + min(context // kv.ratios[s], cfg.index_topk) * entry
            for s in kv.kv_sources
        )
        return int(weights + rows * per_row)
    tokens = min(context, cfg.index_topk * cfg.csa_rate) if CSA in cfg.layer_kinds else context
    return int(weights + rows * tokens * bytes_per_token(cfg, kv_cache_dtype))


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, those one token uses) of the model `cfg` describes, counted on its abstract weights (dense, so a
    packed FP4 code counts as its two values; the hash-routing table and the Engram hash products are not
    parameters): a token uses num_experts_per_tok of the n_routed_experts routed experts, of each Engram table the
    rows its n-grams hash to (counted as none), and every other weight."""
    total = routed = engram = 0
    for name, info in flatten_with_names(abstract_weights(cfg.dequantized()), is_info):
        if not name.endswith(("tid2eid", "ngram_products")):
            count = int(np.prod(info.shape))
            total += count
            routed += count if "experts" in info.axes else 0
            engram += count if "engram_rows" in info.axes else 0
    return total, total - routed - engram + routed * cfg.num_experts_per_tok // cfg.n_routed_experts


@dataclass
class NodeLayout:
    """The mesh `jaxserve plan --num-nodes N --devices-per-node D` plans on (node_layout)."""

    num_nodes: int
    devices_per_node: int
    tensor_parallel_size: int
    expert_parallel_size: int
    # Every layout considered, "TP x EP": the weights' bytes on each device, or why the model cannot be split so.
    candidates: dict[str, int | str]


def node_layout(cfg: ModelConfig, num_nodes: int, devices_per_node: int) -> NodeLayout:
    """The layout for `num_nodes` nodes of `devices_per_node` devices: tensor parallelism inside a node (its
    all-reduces run in every layer, over the node's own links), expert parallelism across the nodes. Candidates:
    every TP that divides devices_per_node, with EP = num_nodes x devices_per_node / TP (the routed experts split
    over all the devices whichever it is: sharding.LOGICAL_AXIS_RULES); of those the mesh can split the model by
    (weight_bytes), the one whose devices hold the least weights, the larger TP on a tie. Usually TP =
    devices_per_node and EP = num_nodes: TP splits attention and the vocabulary too. ConfigError naming the flags
    when the counts are not positive or no candidate splits the model."""
    flags = f"--num-nodes {num_nodes} --devices-per-node {devices_per_node}"
    for name, value in (("--num-nodes", num_nodes), ("--devices-per-node", devices_per_node)):
        if value < 1:
            raise ConfigError(f"{name}={value}: must be a positive integer")
    devices = plan_devices(num_nodes * devices_per_node)
    candidates: dict[str, int | str] = {}
    best: tuple[int, int] | None = None  # (weights per device, -TP)
    for tp in sorted((t for t in range(1, devices_per_node + 1) if devices_per_node % t == 0), reverse=True):
        ep = len(devices) // tp
        try:
            per_device = weight_bytes(cfg, make_mesh(tp, ep, devices))[0]
        except ShardingError as refused:
            candidates[f"{tp} x {ep}"] = str(refused)
            continue
        candidates[f"{tp} x {ep}"] = per_device
        best = min(best or (per_device, -tp), (per_device, -tp))
    if best is None:
        raise ConfigError(
            f"{flags}: no layout with tensor parallelism inside a node splits this model: "
            + "; ".join(f"TP x EP = {layout}: {why}" for layout, why in candidates.items())
        )
    tp = -best[1]
    return NodeLayout(num_nodes, devices_per_node, tp, len(devices) // tp, candidates)


class AbstractRunner:
    """The engine's own step shapes over abstract weights and an abstract cache (its ExecutableCache, with the
    buckets and the kernel choice the engine's runner would have): traced and compiled, never run."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Any,
        geometry: CacheGeometry,
        mesh: Mesh,
        buckets: Buckets,
        kernels: str,
        batch_invariant: bool = False,
    ):
        self.buckets, self.geometry = buckets, geometry
        # The kernel table's choice for these devices (--kernels, --batch-invariant), as the engine's runner makes it.
        self.kernels = step_kernels(cfg, mesh, kernels, batch_invariant)
        self.executables = ExecutableCache(cfg, weights, geometry, mesh, self.kernels)

    def jaxprs(self, shape: StepShape) -> list[ClosedJaxpr]:
        """The step of `shape` as traced, before XLA sees it: its forward and its sampler (or its verify step)."""
        return self.executables.jaxprs(shape)

    def compile_stages(self, shape: StepShape, gpu: str) -> list[list[jax.stages.Compiled]]:
        """`shape` compiled as the engine compiles it (`ExecutableCache.compile`, with no compiler options: for a GPU
        target); StepCompileError naming the shape, `gpu` and the kernel when compiling fails."""
        try:
            return self.executables.compile(shape)
        except Exception as failed:  # noqa: BLE001 - Pallas lowering, Triton, ptxas and XLA raise their own kinds
            raise StepCompileError(shape, gpu, failed) from failed

    def temp_bytes(self, shape: StepShape) -> int:
        """XLA's temporaries of the compiled step of `shape` (per device): its forward's and its sampler's."""
        return self.executables.temp_bytes(shape, ACCELERATOR_LIKE)


def state_bytes(cfg: ModelConfig, geometry: CacheGeometry, mesh: Mesh) -> int:
    """Per device bytes of the cache outside the paged pools (with drafts, their state rows and draft state too)."""
    abstract = abstract_runner_cache(cfg, geometry)
    shardings = shardings_for(abstract, mesh)
    leaves = zip(jax.tree.leaves(abstract, is_leaf=is_info), jax.tree.leaves(shardings))
    return sum(nbytes(info, s.shard_shape(info.shape)) for info, s in leaves if "pages" not in info.axes)


def make_plan(
    cfg: ModelConfig, engine_cfg: EngineConfig, mesh: Mesh, device_memory: int, target: str | None = None
) -> Plan:
    """The plan for serving `cfg` with these engine knobs on `mesh`, `device_memory` usable bytes on each device
    (the vocabulary padded as the loader pads it, `sharding.for_mesh`). Without `target` the temporaries are those of
    the largest decode and prefill steps compiled for the mesh's CPU devices (ACCELERATOR_LIKE); with `target` (a
    jaxserve.runner.targets name, `mesh` over its `target_devices`) every step shape of the buckets is compiled for
    that GPU (compile_every_step), StepCompileError when one fails."""
    gpu = None if target is None else targets.target(target)
    cfg = for_mesh(cfg, mesh)
    per_device, by_format, total = weight_bytes(cfg, mesh)
    geometry = kv_geometry(engine_cfg, cfg)
    max_len = resolve_max_model_len(engine_cfg, cfg)
    state = state_bytes(cfg, geometry, mesh)
    # The single K=V head: every device holds every token's entries.
    kv_per_token = bytes_per_token(cfg, geometry.kv_cache_dtype)
    plan = Plan(
        devices=mesh.size,
        device_memory=device_memory,
        weights_bytes_per_device=per_device,
        weights_bytes_by_format=by_format,
        weights_bytes_total=total,
        temp_bytes_per_device=None,
        state_bytes_per_device=state,
        kv_bytes_per_token=kv_per_token,
        max_kv_tokens=0,
        max_model_len=max_len,
        max_num_seqs=engine_cfg.max_num_seqs,
        max_concurrent_requests=0,
        fits=False,
        reason="",
        target=target,
        disaggregation_mode=engine_cfg.disaggregation_mode,
    )
    if per_device >= device_memory:
        plan.reason = (
            f"weights need {per_device / GB:.1f} GB per device, more than the {device_memory / GB:.1f} GB usable"
        )
        return plan
    temp = 0
    buckets = Buckets.for_config(engine_cfg)
    runner = AbstractRunner(
        cfg,
        shape_dtype_structs(abstract_weights(cfg), mesh),
        geometry,
        mesh,
        buckets,
        kernels=engine_cfg.kernels,
        batch_invariant=engine_cfg.batch_invariant,
    )
    started = time.perf_counter()
    if gpu is not None:
        plan.kernels = runner.kernels.describe()
        plan.steps, plan.decode_estimate = compile_every_step(runner, gpu, cfg, mesh, max_len)
        plan.compiled_steps += [step.shape for step in plan.steps]
        temp = max(step.temp_bytes for step in plan.steps)
    else:
        largest = (
            StepShape(decode=GroupShape(max(buckets.decode_rows), 1)),
            StepShape(prefill=GroupShape(max(buckets.prefill_rows), max(buckets.prefill_chunks))),
        )
        for shape in filter(buckets.runs, largest):  # a disaggregated server's role: its own kind of step only
            temp = max(temp, runner.temp_bytes(shape))
            plan.compiled_steps.append(str(shape))
    plan.compile_s = time.perf_counter() - started
    plan.temp_bytes_per_device = temp
    left = device_memory - per_device - temp - state
    page = engine_cfg.page_size
    plan.max_kv_tokens = max(0, int(left // kv_per_token) // page * page) if kv_per_token else 0
    plan.max_concurrent_requests = min(engine_cfg.max_num_seqs, plan.max_kv_tokens // max_len)
    used = (
        f"weights {per_device / GB:.1f} GB + step temporaries {temp / GB:.1f} GB + per-sequence state "
        f"{state / GB:.2f} GB"
    )
    if left <= 0:
        plan.reason = f"{used} exceed the {device_memory / GB:.1f} GB usable"
    elif plan.max_concurrent_requests < 1:
        plan.reason = (
            f"{used} leave room for {plan.max_kv_tokens} KV tokens, fewer than one request of max_model_len={max_len}"
        )
    else:
        plan.fits = True
        plan.reason = (
            f"{used} leave {left / GB:.1f} GB: {plan.max_kv_tokens} KV tokens, "
            f"{plan.max_concurrent_requests} requests of {max_len} tokens at once"
        )
    return plan


def compile_every_step(
    runner: AbstractRunner, gpu: GpuTarget, cfg: ModelConfig, mesh: Mesh, context: int
) -> tuple[list[StepCompile], DecodeEstimate | None]:
    """Compile every step shape of `runner`'s buckets for `gpu` (runner over its deviceless devices): a StepCompile per
    shape (XLA's temporaries, the seconds its compile took) and, for the largest decode shape, its DecodeEstimate at
    `context` (None for a prefill server's role, which compiles no decode step). The estimate has the cost model's
    times only when JAX started with COST_MODEL_FLAG in XLA_FLAGS (prepare_for_target); without them its model_s is
    0 and every kernel is priced at bandwidth."""
    rows = max(runner.buckets.decode_rows)
    steps = []
    largest = StepShape(decode=GroupShape(rows, 1))  # a prefill server's role has none: no estimate
    profiled: list[jax.stages.Compiled] = []
    for shape in runner.buckets.shapes():
        started = time.perf_counter()
        with targets.persistent_cache_off():
            stages = runner.compile_stages(shape, gpu.name)
        seconds = time.perf_counter() - started
        temp = 0
        for variants in stages:
            temps = []
            for compiled in variants:
                analysis = compiled.memory_analysis()
                if analysis is None:
                    raise RuntimeError(f"XLA has no memory analysis of step {shape} compiled for {gpu.name}")
                temps.append(int(analysis.temp_size_in_bytes))
            temp += max(temps)
        steps.append(StepCompile(str(shape), temp, seconds))
        if shape == largest:
            profiled = [variants[0] for variants in stages]  # the forward and its sampler, or the sampled verify
    if not profiled:
        return steps, None
    profile = step_profile(profiled)
    tokens_per_row = runner.geometry.draft_tokens + 1 if runner.executables.verifies(largest) else 1
    bound = decode_read_bytes(cfg, mesh, rows, context, runner.geometry.kv_cache_dtype, tokens_per_row)
    return steps, DecodeEstimate(
        shape=str(largest),
        rows=rows,
        context=context,
        launches=profile.launches,
        bytes=profile.bytes,
        model_s=profile.model_seconds(),
        estimate_s=profile.estimate(gpu.bandwidth),
        bound_bytes=bound,
        bound_s=bound / gpu.bandwidth,
    )


def prepare_for_target() -> None:
    """Before JAX starts a backend, for compiling for a GPU target in this process: the CPU platform (the CUDA plugin
    then compiles without a driver or a GPU) and XLA's cost-model statistics (targets.ask_for_cost_model); the
    compiles themselves skip the persistent cache (targets.persistent_cache_off). Importing JAX starts no backend;
    once one has started, JAX_PLATFORMS and XLA_FLAGS are read and these come too late: set JAX_PLATFORMS=cpu and
    the flag in the environment before the process starts instead."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    targets.ask_for_cost_model()
