"""The kernel table: the one place that chooses which implementation runs each kernel-worthy operation.

The model calls every such operation through a `Kernels` record made here once (the runner holds it), so nothing
else in jaxserve tests the backend or picks an implementation. `--kernels`:
- `reference`: the pure-JAX references of jaxserve.kernels everywhere: the oracle in tests, and what runs on CPU;
- `pallas`: the Pallas kernel of every operation that has one (on CPU in Pallas's interpret mode, which is how the
  tests run them against their references), the reference for the others;
- `auto`: the Pallas kernels that compile natively for the devices' platform, the references elsewhere (on CPU:
  every reference).
Whatever the choice, on one GPU the forward traces every layer in line rather than scanning a segment's repeats
(`Kernels.unrolled_layers`).

Operations without a Pallas kernel yet run their reference under every choice: the lightning indexer's scoring
and top-k (`kernels.indexer`), FP8 KV storage (`kernels.kv_quant`, reached through `jaxserve.model.cache`), and the
paged reads of compressed entries, which the model gathers before `sink_attention` sees them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from . import attention, indexer, mhc, moe, quant, tiles

log = logging.getLogger("jaxserve.kernels")

KERNEL_CHOICES = ("auto", "reference", "pallas")
REFERENCE, PALLAS = "reference", "pallas"
PALLAS_PLATFORMS = ("gpu", "cuda", "rocm")  # where `pallas_call` lowers natively (Triton); elsewhere: interpret


@dataclass(frozen=True)
class Kernels:
    """One implementation per operation, each with its reference's signature."""

    grouped_matmul: Callable  # kernels.moe.grouped_matmul: rows sorted by expert times their experts' matrices
    expert_rows: Callable  # kernels.moe.expert_rows: a decode step's routed rows, unsorted, times their experts
    gated_matmul: Callable  # kernels.moe.gated_matmul: the shared expert's gate and up projections and SwiGLU
    einsum: Callable  # kernels.quant.einsum: an activation times a weight that may be block-scaled FP8 / FP4
    sink_attention: Callable  # kernels.attention.sink_attention: shared + selected keys, per-head sinks
    indexer_topk: Callable  # kernels.indexer.indexer_topk: CSA's entry scores and top-k
    hc_pre: Callable  # kernels.mhc.hc_pre: mHC's collapse of the streams, with its Sinkhorn mixing matrices
    hc_head: Callable  # kernels.mhc.hc_head: the final collapse of the streams and the final norm
    implementations: tuple[tuple[str, str], ...] = ()  # (operation, "reference" or "pallas"), for logs and reports
    # How the forward walks a segment's repeated layers on one device: one traced body scanned (a while loop), or
    # every layer traced in line. Unrolled, a GPU step launches no per-layer loop overhead (the loop's condition, the
    # copies of its carry, a slice of each stacked small weight a Triton or Pallas consumer cannot read in place: 14
    # launches a layer of Flash's 75) for a compile about a second a layer longer; on CPU the scan keeps compiles
    # short, and under a mesh that splits the weights the forward scans (jaxserve.model.forward.run_segment).
    unrolled_layers: bool = False
    # Batch-invariant serving (--batch-invariant): the rows of every row-wise computation of a step go through
    # `rows` in tiles of this many (kernels.tiles); None: as they come.
    row_tile: int | None = None

    def rows(self, fn: Callable[..., Any], *arrays: Any, lead: int = 1) -> Any:
        """fn(*arrays), where fn treats the rows (the `lead` leading axes of every array) independently: computed in
        fixed tiles of `row_tile` rows when batch-invariant (kernels.tiles.rowwise), at once otherwise."""
        if self.row_tile is None:
            return fn(*arrays)
        return tiles.rowwise(fn, arrays, lead, self.row_tile)

    @property
    def compiler_options(self) -> tuple[tuple[str, Any], ...]:
        """XLA's options for every step compiled through this table: when batch-invariant, no code moves into or out of
        a loop (kernels.tiles: a tile's body is then compiled the same in every step; with the weights' conversions
        hoisted out of it, XLA:CPU split a bfloat16 row's matmul differently in steps of different chunk sizes)."""
        if self.row_tile is None:
            return ()
        return (("xla_disable_hlo_passes", "while-loop-invariant-code-motion"),)

    def describe(self) -> str:
        layers = ", layers unrolled on one device" if self.unrolled_layers else ""
        invariant = f", rows in tiles of {self.row_tile} (batch-invariant)" if self.row_tile else ""
        return ", ".join(f"{op} {impl}" for op, impl in self.implementations) + layers + invariant


OPERATIONS = tuple(f.name for f in fields(Kernels) if f.name not in ("implementations", "unrolled_layers", "row_tile"))

REFERENCES: dict[str, Callable] = {
    "grouped_matmul": moe.grouped_matmul,
    "expert_rows": moe.expert_rows,
    "gated_matmul": moe.gated_matmul,
    "einsum": quant.einsum,
    "sink_attention": attention.sink_attention,
    "indexer_topk": indexer.indexer_topk,
    "hc_pre": mhc.hc_pre,
    "hc_head": mhc.hc_head,
}


def _pallas_kernels() -> dict[str, Callable]:
    """The operations that have a Pallas kernel (imported on first use: Pallas is only loaded when asked for)."""
    from .pallas import block_scaled_matmul, expert_rows, grouped_matmul, mhc, sparse_attention

    return {
        "grouped_matmul": grouped_matmul.grouped_matmul,
        "expert_rows": expert_rows.expert_rows,
        "gated_matmul": expert_rows.gated_matmul,
        "einsum": block_scaled_matmul.einsum,
        "sink_attention": sparse_attention.sink_attention,
        "hc_pre": mhc.hc_pre,
        "hc_head": mhc.hc_head,
    }


def pallas_hbm_bytes() -> dict[str, Callable]:
    """Pallas kernels that read less than their whole operands, by kernel name: each one's own statement of the HBM
    bytes a call moves, from its operands' shapes and bytes as compiled (for static profiles of compiled steps)."""
    from .pallas import expert_rows, grouped_matmul, mhc

    return {
        "grouped_matmul": grouped_matmul.hbm_bytes,
        "expert_rows": expert_rows.hbm_bytes,
        "hc_mixes": mhc.mixes_hbm_bytes,
        "hc_collapse": mhc.collapse_hbm_bytes,
    }


def check_choice(choice: str) -> None:
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels={choice!r}: must be one of {KERNEL_CHOICES}")


@functools.cache
def kernels_for(choice: str, platform: str, row_tile: int | None = None) -> Kernels:
    """The implementations `--kernels choice` means on devices of `platform` ("cpu", "gpu", "cuda", "tpu", ...),
    with every row-wise computation in tiles of `row_tile` rows (batch-invariant serving; None: off). Cached: one
    record per (choice, platform, row_tile), so equal choices share compiled steps."""
    check_choice(choice)
    native = platform in PALLAS_PLATFORMS
    use_pallas = choice == PALLAS or (choice == "auto" and native)
    chosen = dict(REFERENCES)
    if native:  # XLA fuses the expert gather and decode into the reduction that consumes them (kernels.moe)
        chosen["grouped_matmul"] = functools.partial(moe.grouped_matmul, fused_decode=True)
        chosen["expert_rows"] = functools.partial(moe.expert_rows, fused_decode=True)
    implementations = {op: REFERENCE for op in OPERATIONS}
    if use_pallas:
        for op, kernel in _pallas_kernels().items():
            chosen[op] = kernel if native else functools.partial(kernel, interpret=True)
            implementations[op] = PALLAS if native else f"{PALLAS} (interpret)"
        if choice == PALLAS:
            missing = [op for op, impl in implementations.items() if impl == REFERENCE]
            log.warning("--kernels pallas: no Pallas kernel yet for %s; their references run", ", ".join(missing))
    return Kernels(**chosen, implementations=tuple(implementations.items()), unrolled_layers=native, row_tile=row_tile)


REFERENCE_KERNELS = kernels_for(REFERENCE, "cpu")
