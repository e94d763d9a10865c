"""The device mesh and the one table that maps logical axes to mesh axes.

Mesh axes: `expert` x `tensor`. Attention heads (and the shared expert's width, and the vocabulary of the
head) split over `tensor`; routed experts split over both axes, so every device holds 1/devices of them
whatever the split. The single K=V head means the KV state is replicated. Model code names logical axes
only; `logical_spec` turns them into PartitionSpecs here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.kernels.quant import Quantized
from jaxserve.model.weights import ArrayInfo, is_info, is_weight

EXPERT, TENSOR = "expert", "tensor"
MESH_AXES = (EXPERT, TENSOR)

# logical axis -> mesh axis (or axes); anything not listed is replicated.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,  # the stacked layers a scan walks: every device holds its slice of every layer
    "heads": TENSOR,
    "index_heads": TENSOR,
    "experts": (EXPERT, TENSOR),
    "ffw": TENSOR,
    "vocab": TENSOR,
    # DeepSeek-V4.1's Engram tables (about 100 GB each): split like the vocabulary (each device gathers the rows it
    # holds, the others add zeros), padded alike (ModelConfig.vocab_multiple)
    "engram_rows": TENSOR,
}


def logical_spec(axes: tuple[str | None, ...]) -> PartitionSpec:
    return PartitionSpec(*(LOGICAL_AXIS_RULES.get(a) if a is not None else None for a in axes))


def make_mesh(tensor_parallel_size: int = 1, expert_parallel_size: int = 1, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    needed = tensor_parallel_size * expert_parallel_size
    if tensor_parallel_size < 1 or expert_parallel_size < 1:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size}, expert_parallel_size="
            f"{expert_parallel_size}: both must be >= 1"
        )
    if needed > len(devices):
        raise ValueError(
            f"tensor_parallel_size x expert_parallel_size = {needed} devices, but only {len(devices)} are available"
        )
    grid = np.array(devices[:needed]).reshape(expert_parallel_size, tensor_parallel_size)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


# The flag that sets each mesh axis's size, to name in errors.
PARALLEL_FLAGS = {EXPERT: "expert_parallel_size", TENSOR: "tensor_parallel_size"}


class ShardingError(ValueError):
    """The mesh cannot make a split the logical-axis table asks for."""


def _splits(axes: tuple[str | None, ...], mesh: Mesh):
    """(logical axis, the flags that size its mesh axes, ways) per axis."""
    for logical, mesh_axes in zip(axes, logical_spec(axes)):
        names = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
        ways = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        yield logical, " x ".join(f"{PARALLEL_FLAGS[n]}={mesh.shape[n]}" for n in names), ways


def for_mesh(cfg: ModelConfig, mesh: Mesh) -> ModelConfig:
    """`cfg` with its vocabulary padded to a multiple of the ways `mesh` splits it (as vLLM and SGLang pad theirs),
    so that any vocabulary splits over any tensor-parallel size; the checkpoints hold `cfg.vocab_size` rows."""
    ((_, _, ways),) = _splits(("vocab",), mesh)
    return cfg.with_vocab_multiple(ways)


def vocab_padding_line(cfg: ModelConfig, mesh: Mesh) -> str | None:
    """The start-up log's line on the padding `for_mesh` gives the vocabulary of `cfg` on `mesh` (None: none)."""
    padded = for_mesh(cfg, mesh).padded_vocab_size
    if padded == cfg.vocab_size:
        return None
    ((_, flags, _),) = _splits(("vocab",), mesh)
    return f"vocabulary: {cfg.vocab_size} tokens, padded to {padded} rows (zeros, never sampled) to split over {flags}"


def _split_problems(weight: ArrayInfo | Quantized, mesh: Mesh) -> list[str]:
    """What the mesh cannot split in one (abstract) weight. A quantized weight is judged by its decoded shape: a
    shard must hold whole scale blocks, or its codes and its scales would be split at different places (a block
    that spans the whole axis has one scale, replicated, and is no obstacle)."""
    fmt: str | None = None  # the quantized format, the only kind of weight with scale blocks
    if isinstance(weight, ArrayInfo):
        axes, shape, blocks = weight.axes, weight.shape, (1,) * len(weight.shape)
    else:
        axes, shape, fmt = weight.codes.axes, weight.shape, weight.format
        blocks = (1,) * (len(shape) - len(weight.blocks)) + weight.blocks
    problems = []
    for (logical, flags, ways), size, block in zip(_splits(axes, mesh), shape, blocks):
        if size % ways:
            problems.append(f"cannot split {logical} ({size}) over {flags}: {size} is not a multiple of {ways}")
        elif ways > 1 and block < size and (size // ways) % block:
            problems.append(
                f"cannot split {logical} ({size}) over {flags}: a shard of {size // ways} would cut "
                f"its {fmt} scale blocks of {block} (use --quantization none, or sizes that "
                "keep whole blocks)"
            )
    return problems


def _named_shardings(abstract: Any, mesh: Mesh, make: Callable[[ArrayInfo, NamedSharding], Any]) -> Any:
    """`make(info, sharding)` at every leaf. A split the mesh cannot make is refused, never silently replicated:
    one ShardingError names every such axis, its size and the parallel sizes."""
    found: dict[str, str] = {}  # problem -> the first weight it was found in
    for path, weight in jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_weight)[0]:
        for problem in _split_problems(weight, mesh):
            found.setdefault(problem, jax.tree_util.keystr(path))
    if found:
        raise ShardingError(
            "; ".join(f"{problem} (first in {where})" for problem, where in found.items())
            + "; choose parallel sizes that divide them"
        )
    return jax.tree.map(
        lambda info: make(info, NamedSharding(mesh, logical_spec(info.axes), memory_kind=info.memory)),
        abstract,
        is_leaf=is_info,
    )


def shardings_for(abstract: Any, mesh: Mesh) -> Any:
    """NamedShardings for every ArrayInfo leaf of an abstract tree (weights or cache); ShardingError when the mesh
    cannot split an axis the table shards."""
    return _named_shardings(abstract, mesh, lambda info, sharding: sharding)


def shape_dtype_structs(abstract: Any, mesh: Mesh) -> Any:
    """Restore targets: ShapeDtypeStructs carrying the target shardings."""
    return _named_shardings(
        abstract, mesh, lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding)
    )


def expert_axes() -> tuple[str, ...]:
    """The mesh axes routed experts are split over."""
    axes = LOGICAL_AXIS_RULES["experts"]
    return (axes,) if isinstance(axes, str) else (axes or ())


def place(tree: Any, abstract: Any, mesh: Mesh) -> Any:
    """Put an array tree onto the mesh with the shardings its abstract description implies."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s), tree, shardings_for(abstract, mesh))
