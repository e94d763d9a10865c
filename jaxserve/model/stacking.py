"""Stacked Weights assembled on the mesh from per-layer leaves, as a checkpoint is read one tensor at a time.

Checkpoints name leaves per layer (`release_leaves`); Weights hold the layers of a segment stacked along a leading
`layers` axis. Host memory holds one leaf at a time, device memory the model plus one layer:
- a stack of one layer is that layer's leaf with a unit axis put straight into its sharding (no compile);
- a longer stack is allocated once, then each layer's leaves, gathered until the layer is complete, are written
  into it in place by one jitted update per stacked `Layer` (one compile per position of a segment's pattern,
  whatever the number of repeats).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.model.weights import (
    DERIVED_LEAVES,
    ArrayInfo,
    Weights,
    abstract_weights,
    flatten_with_names,
    is_info,
    release_leaves,
)


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(stacks: list[jax.Array], layer: list[jax.Array], index: jax.Array) -> list[jax.Array]:
    return [jax.lax.dynamic_update_index_in_dim(stack, leaf, index, 0) for stack, leaf in zip(stacks, layer)]


def _zeros(infos: list[ArrayInfo], shardings: list[NamedSharding] | None) -> list[jax.Array]:
    shapes = [(info.shape, info.dtype) for info in infos]
    return jax.jit(lambda: [jnp.zeros(shape, dtype) for shape, dtype in shapes], out_shardings=shardings)()


def _one_layer(sharding: NamedSharding | None) -> NamedSharding | None:
    """The sharding of one layer of a stack sharded as `sharding` (the layers axis is never split)."""
    return None if sharding is None else NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))


def _place(array: Any, sharding: NamedSharding | None) -> jax.Array:
    """A host array goes onto its sharding one shard at a time, each process writing only its own devices' shards
    (jax.device_put would first check, across the processes of a multi-process group, that each passes the same whole
    array); a device array moves as it is."""
    if sharding is None or isinstance(array, jax.Array):
        return jax.device_put(array, sharding)
    host = np.asarray(array)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@functools.cache
def _with_layers_axis(sharding: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    """One jitted "add a unit layers axis" per target sharding (compiled once per leaf shape, not per call)."""
    return jax.jit(lambda array: array[None], out_shardings=sharding)


def _place_as_stack(array: Any, sharding: NamedSharding | None) -> jax.Array:
    """A stack of one layer: `array` with a unit layers axis, placed as `sharding` says (a device array, an orbax
    restore's, gets it on the devices: its shards may live in other processes, out of the host's reach)."""
    if isinstance(array, jax.Array) and sharding is not None:
        return _with_layers_axis(sharding)(array)
    return _place(np.asarray(array)[None], sharding)


def _stack_of(path: str) -> str | None:
    """'segments.2.1.attn.wq_b' -> 'segments.2.1', 'dspark.stages.attn.wq_b' -> 'dspark.stages': the stacked Layer
    a leaf belongs to (None: none)."""
    parts = path.split(".")
    if parts[0] == "segments":
        return ".".join(parts[:3])
    return "dspark.stages" if parts[:2] == ["dspark", "stages"] else None


class WeightsBuilder:
    """Takes every leaf of the un-stacked model once (`put`, by release name, in any order), returns Weights
    placed with `shardings` (a Weights tree of NamedShardings; None: the default device). A quantized weight is
    put whole (a Quantized of its codes and scales); each part is stacked and placed like any leaf."""

    def __init__(self, cfg: ModelConfig, shardings: Weights | None = None):
        abstract = abstract_weights(cfg)
        named = flatten_with_names(abstract)
        self._structure = jax.tree.structure(abstract, is_leaf=is_info)
        self._paths = [path for path, _ in named]
        self._infos = dict(named)
        self._shardings = dict(zip(self._paths, jax.tree.leaves(shardings))) if shardings is not None else None
        self._layout = {leaf.name: leaf for leaf in release_leaves(cfg)}
        self._stack_paths: dict[str, list[str]] = {}
        for path in self._paths:
            if (stack := _stack_of(path)) is not None:
                self._stack_paths.setdefault(stack, []).append(path)
        self._arrays: dict[str, jax.Array] = {}
        self._pending: dict[tuple[str, int], dict[str, jax.Array]] = {}  # (stack, layer index) -> its leaves so far
        self._received: set[str] = set()

    def _sharding(self, path: str) -> NamedSharding | None:
        return None if self._shardings is None else self._shardings[path]

    def put(self, name: str, value: Any) -> None:
        """One leaf (host or device array, or a Quantized of them) of the un-stacked model, shaped and typed as
        `release_leaves` says."""
        if name not in self._layout:
            raise ValueError(f"{name}: not a leaf of this model")
        if name in self._received:
            raise ValueError(f"{name}: given twice")
        leaf = self._layout[name]
        parts = flatten_with_names(leaf.info)
        # jaxlib ships no stubs, so mypy sees PyTreeDef as an unresolved type it cannot compare
        if jax.tree.structure(value) != jax.tree.structure(leaf.info, is_leaf=is_info):  # type: ignore[operator]
            raise ValueError(
                f"{name}: got {type(value).__name__}, the model keeps it as "
                f"{type(leaf.info).__name__} ({', '.join(part or 'array' for part, _ in parts)})"
            )
        arrays = jax.tree.leaves(value)
        for (part, info), array in zip(parts, arrays):
            if tuple(array.shape) != info.shape or jnp.dtype(array.dtype) != jnp.dtype(info.dtype):
                raise ValueError(
                    f"{'.'.join(filter(None, (name, part)))}: got {array.dtype}{list(array.shape)}, "
                    f"the model needs {jnp.dtype(info.dtype)}{list(info.shape)}"
                )
        self._received.add(name)
        for (part, _), array in zip(parts, arrays):
            self._put_part(".".join(filter(None, (leaf.path, part))), leaf.index, array)

    def _put_part(self, path: str, index: int | None, array: Any) -> None:
        sharding = self._sharding(path)
        if index is None:
            self._arrays[path] = _place(array, sharding)
        elif self._infos[path].shape[0] == 1:
            self._arrays[path] = _place_as_stack(array, sharding)
        else:
            stack = _stack_of(path)
            assert stack is not None  # a leaf with a layer index lives in a stack
            layer = self._pending.setdefault((stack, index), {})
            layer[path] = _place(array, _one_layer(sharding))
            if len(layer) == len(self._stack_paths[stack]):
                self._write(stack, index, self._pending.pop((stack, index)))

    def _write(self, stack: str, index: int, layer: dict[str, jax.Array]) -> None:
        paths = self._stack_paths[stack]
        if paths[0] not in self._arrays:
            shardings = None if self._shardings is None else [self._shardings[p] for p in paths]
            self._arrays.update(zip(paths, _zeros([self._infos[p] for p in paths], shardings)))
        written = _write_layer([self._arrays[p] for p in paths], [layer[p] for p in paths], np.int32(index))
        self._arrays.update(zip(paths, written))

    def held_rows(self, name: str) -> set[int] | None:
        """The indices along its first axis of leaf `name` (as `release_leaves` names it) that this process's devices
        hold, when they hold only some (a multi-process group splitting the routed experts); None: all of them."""
        leaf = self._layout[name]
        path = flatten_with_names(leaf.info)[0][0]
        sharding = self._sharding(".".join(filter(None, (leaf.path, path))))
        if sharding is None or sharding.is_fully_addressable:
            return None
        if leaf.index is not None:
            sharding = _one_layer(sharding)
        assert sharding is not None
        rows = leaf.stored.shape[0]
        held: set[int] = set()
        for index in sharding.addressable_devices_indices_map((rows,) + tuple(leaf.stored.shape[1:])).values():
            if index is None:  # a device that holds the whole leaf
                return None
            held.update(range(*index[0].indices(rows)))
        return held if len(held) < rows else None

    def finish(self) -> Weights:
        missing = [name for name in self._layout if name not in self._received]
        if missing:
            raise ValueError(f"{len(missing)} leaves never given, e.g. {missing[:5]}")
        for path in DERIVED_LEAVES:  # zeros until the loader makes them (no checkpoint tensor holds them)
            if path in self._infos and path not in self._arrays:
                info = self._infos[path]
                self._arrays[path] = _place(np.zeros(info.shape, info.dtype), self._sharding(path))
        return jax.tree.unflatten(self._structure, [self._arrays[path] for path in self._paths])
