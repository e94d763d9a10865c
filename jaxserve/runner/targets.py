"""GPUs to compile for without one: target descriptions and deviceless devices (JAX's ahead-of-time topologies).

jaxlib's CUDA plugin compiles for a GPU it is told about in a `GpuTargetConfigProto` (XLA's name); no driver and no
GPU are needed, only `ptxas` (the CUDA toolkit's, or the `nvidia-cuda-nvcc-cu12` wheel's) and JAX started on the
CPU platform. The facts below are those of XLA's own target specs (`xla/backends/gpu/target_config/specs/`), kept
as data; `target_devices` gives N such devices to build a mesh over, and `jit(...).lower(...).compile()` on that
mesh then runs XLA's whole GPU pipeline: fusion, Triton (Pallas kernels included), ptxas, memory analysis.
Nothing compiled this way can run: there is no device to run it on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# Rates by XLA PrimitiveType number (2 s8, 4 s32, 6 u8, 8 u32, 10 f16, 11 f32, 12 f64, 16 bf16, 19-36 the fp8 / fp4
# types): (clock GHz, units per core, ops per clock), as XLA's specs give them.
Rates = dict[int, tuple[float, int, int]]


def _scalar_rates(clock_ghz: float, half_ops: int) -> Rates:
    """CUDA cores: 64 a core for 32- and 64-bit integers and f64, 128 for f32, 16-bit floats at `half_ops` a clock."""
    return {
        4: (clock_ghz, 64, 1),
        8: (clock_ghz, 64, 1),
        10: (clock_ghz, 128, half_ops),
        11: (clock_ghz, 128, 1),
        12: (clock_ghz, 64, 1),
        16: (clock_ghz, 128, half_ops),
    }


def _tensor_rates(clock_ghz: float, f64_clock_ghz: float, byte_ops: int, f64_ops: int, fp4: bool = False) -> Rates:
    """Tensor cores, 4 a core: 8-bit types at `byte_ops` a clock, 16-bit floats at half that, f32 at a quarter, f64
    at `f64_ops` (on the CUDA-core clock); with `fp4`, e2m1 at twice the 8-bit rate (Blackwell)."""
    rates: Rates = {key: (clock_ghz, 4, byte_ops) for key in (2, 6, 19, 20, 23, 24, 25, 28, 29, 33, 35, 36)}
    rates.update({10: (clock_ghz, 4, byte_ops // 2), 16: (clock_ghz, 4, byte_ops // 2)})
    rates.update({11: (clock_ghz, 4, byte_ops // 4), 12: (f64_clock_ghz, 4, f64_ops)})
    if fp4:
        rates[32] = (clock_ghz, 4, 2 * byte_ops)
    return rates


_BF16 = 16


@dataclass(frozen=True)
class GpuTarget:
    """One GPU model as XLA's compiler sees it."""

    name: str  # the device_kind JAX reports
    compute_capability: int  # major; minor 0 with the accelerated features ("sm_90a", "sm_100a")
    cores: int  # streaming multiprocessors
    memory_bytes: int  # what the driver reports (not the marketing size)
    bandwidth: float  # HBM bytes/s
    l2_bytes: int
    clock_ghz: float
    memory_clock_khz: int
    pcie_bandwidth: int
    scalar: Rates = field(repr=False)
    matrix: Rates = field(repr=False)
    dnn: tuple[int, int, int] = (9, 10, 0)

    @property
    def peak_bf16_flops(self) -> float:
        """Dense bf16 tensor-core FLOP/s (an FMA is two): the compute bound of a prefill step."""
        clock, units, ops = self.matrix[_BF16]
        return clock * 1e9 * units * ops * self.cores * 2

    def textproto(self) -> str:
        """The `GpuTargetConfigProto` of this GPU, in text format (the fields jaxlib 0.10's proto knows)."""

        def rates(kind: str, table: Rates) -> str:
            entries = "".join(
                f"    rate_infos {{ key: {key} value {{ clock_rate_ghz: {clock} units_per_core: {units} "
                f"ops_per_clock: {ops} }} }}\n"
                for key, (clock, units, ops) in sorted(table.items())
            )
            return f"  {kind} {{\n{entries}  }}"

        major, (dnn_major, dnn_minor, dnn_patch) = self.compute_capability, self.dnn
        lines = [
            "gpu_device_info {",
            "  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152",
            "  shared_memory_per_core: 233472 threads_per_core_limit: 2048",
            f"  core_count: {self.cores} fpus_per_core: 128",
            "  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535",
            f"  memory_bandwidth: {int(self.bandwidth)} l2_cache_size: {self.l2_bytes}",
            f"  clock_rate_ghz: {self.clock_ghz} device_memory_size: {self.memory_bytes}",
            "  shared_memory_per_block_optin: 232448",
            f"  cuda_compute_capability {{ major: {major} feature_extension: ACCELERATED_FEATURES }}",
            "  registers_per_core_limit: 65536 registers_per_block_limit: 65536",
            rates("scalar_unit_description", self.scalar) + rates("matrix_unit_description", self.matrix),
            "  thread_dim_limit_x: 1024 thread_dim_limit_y: 1024 thread_dim_limit_z: 64",
            '  device_vendor: "NVIDIA Corporation"',
            f'  platform_version: "Compute Capability {major}.0a"',
            f'  model_str: "sm_{major}.0a with {self.memory_bytes}B RAM, {self.cores} cores, '
            f'{round(self.clock_ghz * 1e6)}KHz clock, {self.memory_clock_khz}KHz mem clock, {self.l2_bytes}B L2$"',
            f"  device_address_bits: 64 pcie_bandwidth: {self.pcie_bandwidth} ecc_enabled: true",
            f'  name: "{self.name}"',
            '  driver_version: "13.0.0" runtime_version: "12.8.0" compile_time_toolkit_version: "12.8.0"',
            f'  dnn_version: "{dnn_major}.{dnn_minor}.{dnn_patch}" cub_version: "3.1.2"',
            "  device_interconnect_info { active_links: 18 }",
            "}",
            'platform_name: "CUDA"',
            f"dnn_version_info {{ major: {dnn_major} minor: {dnn_minor} patch: {dnn_patch} }}",
            f'device_description_str: "{self.name}"',
        ]
        return "\n".join(lines) + "\n"


_HOPPER: dict[str, Any] = dict(  # what the H100 and H200 share: the same chip
    compute_capability=9,
    cores=132,
    l2_bytes=52_428_800,
    clock_ghz=1.98,
    pcie_bandwidth=34_359_738_368,
    scalar=_scalar_rates(1.98, 2),
    matrix=_tensor_rates(1.8295201, 1.98, 1024, 32),
)
TARGETS: dict[str, GpuTarget] = {
    "h200": GpuTarget(
        "NVIDIA H200 141GB HBM3e", memory_bytes=151_397_597_184, bandwidth=4.8e12, memory_clock_khz=3_750_000, **_HOPPER
    ),
    "h100": GpuTarget(
        "NVIDIA H100 80GB HBM3",
        memory_bytes=84_942_979_072,
        bandwidth=3.35232e12,
        memory_clock_khz=2_619_000,
        **_HOPPER,
    ),
    "b200": GpuTarget(
        "NVIDIA B200",
        compute_capability=10,
        cores=148,
        memory_bytes=191_514_411_008,
        bandwidth=7.67232e12,
        l2_bytes=132_644_864,
        clock_ghz=1.965,
        memory_clock_khz=3_996_000,
        pcie_bandwidth=68_719_476_736,
        scalar=_scalar_rates(1.965, 1),
        matrix=_tensor_rates(1.8353101, 1.965, 2048, 16, fp4=True),
        dnn=(9, 7, 0),
    ),
}


# XLA's GPU cost models write each fusion's estimated time into its backend config only with this flag, which must
# be in XLA_FLAGS before JAX starts (jaxserve.runner.hlo_profile reads those times).
COST_MODEL_FLAG = "--xla_gpu_collect_cost_model_stats=true"


# A cheap XLA:CPU compile: no LLVM optimization of the generated code (the fusions stay XLA's). For the test suite
# and benchmarks' CPU smoke runs, where compiles take most of the time and no timing is read. `jaxserve generate` on
# the embedded model, 400 tokens, idle 2 cores: its 2 step shapes compiled in 8.5 s instead of 12.6-12.9 s, and its
# run took 0.7 s longer; adding --xla_llvm_disable_expensive_passes and the older loop emitters
# (--xla_cpu_use_fusion_emitters=false) compiled in 7.7 s but ran 2.5 s longer.
CHEAP_CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",)


# XLA:CPU runs a while loop whose ops together touch more bytes than this threshold as thunks, one dispatch per op per
# iteration, and a smaller one as one compiled kernel. At its default, mHC's Sinkhorn loop (19 iterations over [rows,
# n, n]) went op by op from 4 rows a step on: 0.28 ms a hyper-connection site instead of 7 us on the embedded default,
# so a 4-token verify cost 1.65x a 1-token forward. At 64 KiB, paired on a 2-core machine: a 1-token forward 3.14 ->
# 2.59 ms, 4 tokens 5.17 -> 3.59, an MTP k = 1 step 5.57 -> 4.29, a DSpark N = 3 step 7.92 -> 6.10; compile time
# unchanged. Only XLA:CPU reads the option.
CPU_SMALL_LOOP_OPTION = ("xla_cpu_small_while_loop_byte_threshold", "65536")

# XLA:CPU's copy insertion, ordering instructions by their dependencies alone, keeps a copy of a donated array that
# one fusion reads while another updates it in place, unless the read is an operand of the update: a layer's window
# ring is read by the fusions that gather its keys and written back by another, so every step copied each layer's
# whole ring twice (the server's geometry: 6.9 MB a DSpark N = 3 step, 6.0 MB an MTP k = 2 step, 1.3 MB a plain
# decode step). With region-based live-range analysis it finds those copies unneeded (0.1 MB, 0.1 MB, none; results
# bit for bit the same): paired, a DSpark N = 3 step 0.85x, MTP k = 2 0.88x, a 1-token forward 0.86x. Only XLA:CPU
# reads the flag.
CPU_COPY_ANALYSIS_FLAG = "--xla_cpu_copy_insertion_use_region_analysis=true"


def add_xla_flags(*flags: str) -> None:
    """Add `flags` to XLA_FLAGS, each unless XLA_FLAGS sets that flag already (the user's value stands): effective
    only before JAX starts its first backend."""
    present = os.environ.get("XLA_FLAGS", "").split()
    named = {flag.split("=")[0] for flag in present}
    os.environ["XLA_FLAGS"] = " ".join(present + [flag for flag in flags if flag.split("=")[0] not in named])


def add_backend_extra_option(key: str, value: str) -> None:
    """Add `key=value` to XLA_FLAGS' --xla_backend_extra_options (one flag, a comma-separated list), unless the key
    is set there already (the user's value stands): effective only before JAX starts its first backend."""
    prefix = "--xla_backend_extra_options="
    flags = os.environ.get("XLA_FLAGS", "").split()
    given = [i for i, flag in enumerate(flags) if flag.startswith(prefix)]
    if not given:
        flags.append(f"{prefix}{key}={value}")
    elif key not in (option.split("=")[0] for option in flags[given[-1]][len(prefix) :].split(",")):
        flags[given[-1]] += f",{key}={value}"
    os.environ["XLA_FLAGS"] = " ".join(flags)


def ask_for_cost_model() -> None:
    add_xla_flags(COST_MODEL_FLAG)


def tune_xla_cpu() -> None:
    """XLA:CPU's options for jaxserve's steps, each unless the user set it: the small-loop threshold
    (CPU_SMALL_LOOP_OPTION) and copy insertion's region analysis (CPU_COPY_ANALYSIS_FLAG). Before any backend
    starts."""
    add_backend_extra_option(*CPU_SMALL_LOOP_OPTION)
    add_xla_flags(CPU_COPY_ANALYSIS_FLAG)


class TargetError(RuntimeError):
    """Compiling for a GPU target cannot start here: what is missing and how to get it."""


def target(name: str) -> GpuTarget:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"--target {name!r}: must be one of {', '.join(TARGETS)}") from None


def target_devices(name: str, count: int) -> list:
    """`count` deviceless devices of GPU `name` on one host, to build a mesh over and compile for (never to run on).
    TargetError naming the missing piece: the CUDA plugin (the project's `gpu-aot` extra), JAX not started on the
    CPU platform (the plugin would look for a driver), or no `ptxas` (found when the first step compiles)."""
    import jax
    from jax.experimental import topologies

    try:
        import jax_plugins.xla_cuda12  # noqa: F401  (the plugin that compiles for CUDA)
    except ImportError:
        raise TargetError(
            "compiling for a GPU needs jaxlib's CUDA plugin: pip install 'jaxserve[gpu-aot]' "
            "(jax-cuda12-plugin and jax-cuda12-pjrt, no CUDA runtime wheels)"
        ) from None
    platforms = jax.config.values["jax_platforms"] or os.environ.get("JAX_PLATFORMS", "")
    if platforms != "cpu":
        raise TargetError(f"compiling for a GPU target needs JAX_PLATFORMS=cpu before JAX starts (it is {platforms!r})")
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target(name).textproto(), topology=f"1x1x{count}"
        )
    except Exception as failed:  # jaxlib raises its own XlaRuntimeError / ValueError / RuntimeError here
        raise TargetError(
            f"no deviceless {name} topology of {count} device(s): {failed} (JAX_PLATFORMS must be cpu before JAX "
            "starts, with jax-cuda12-plugin of jax's version installed)"
        ) from failed
    return list(topology.devices)


@contextlib.contextmanager
def persistent_cache_off() -> Iterator[None]:
    """JAX's persistent compilation cache cannot load a deviceless executable back (it has no client to load it
    into, and warns), so target compiles neither read nor write it."""
    import jax
    from jax._src import compilation_cache  # JAX decides once whether the cache is used; reset_cache asks again

    before = jax.config.values["jax_enable_compilation_cache"]
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def compile_for_target(jitted: Any, *args: Any, **kwargs: Any) -> Any:
    """`jitted` lowered for `args` (ShapeDtypeStructs on a mesh of `target_devices`) and compiled for that GPU."""
    with persistent_cache_off():
        return jitted.lower(*args, **kwargs).compile()
