"""Traced step calls kept on disk, so that a start whose shapes are all in JAX's persistent compilation cache does not
trace them again.

JAX's compilation cache keys an executable by the lowered program, so even a start that finds every executable
there first traces and lowers every call: for a small model most of a warm start. This store keeps each call's
program as JAX exported it (`jax.export`, over the call's flattened arguments) beside that cache, and a start that
finds it lowers a thin call of the exported program instead and compiles that (a cache hit, as the program compiled
is always that same thin call). An entry is keyed by everything the traced program depends on: jaxserve's own source
files, JAX's version and trace-relevant configuration, the devices, what the call closes over (described by its
owner, jaxserve.runner.executables) and each argument's shape, dtype and sharding. A call JAX cannot export (a
custom call without a stable form, such as a Triton kernel) is traced each start, as without the store.

The store is on where JAX's persistent compilation cache is (`--compilation-cache-dir`), in its `jaxserve-exported`
folder; like that cache's executables, its entries are trusted (a pickled output tree).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import pickle
import tempfile
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

import jax
from jax import export
from jax.sharding import Mesh, NamedSharding

log = logging.getLogger(__name__)

FOLDER = "jaxserve-exported"
FORMAT = 1  # raised whenever an entry's layout changes


@dataclasses.dataclass(frozen=True)
class JitSpec:
    """How one call is jitted: the one description both its plain jit and its exported program's call are made from."""

    fn: Callable
    donate_argnames: tuple[str, ...] = ()
    static_argnames: tuple[str, ...] = ()
    out_shardings: Any = None
    compiler_options: tuple[tuple[str, Any], ...] = ()  # XLA's, as (name, value) pairs (Kernels.compiler_options)

    @functools.cached_property
    def jitted(self) -> Any:
        return jax.jit(
            self.fn,
            donate_argnames=self.donate_argnames,
            static_argnames=self.static_argnames,
            out_shardings=self.out_shardings,
            compiler_options=dict(self.compiler_options) or None,
        )


def describe(value: Any) -> str:
    """A description of `value` that is the same in every process for equal values (no object addresses):
    functions by their qualified names, dataclasses by their fields, meshes by their devices."""
    if isinstance(value, functools.partial):
        return f"partial({describe(value.func)}, {describe(value.args)}, {describe(value.keywords)})"
    if callable(value) and hasattr(value, "__wrapped__"):  # a jitted or decorated function: its source says how
        return f"wrapped({describe(value.__wrapped__)})"
    if inspect.isfunction(value) or inspect.isbuiltin(value) or inspect.isclass(value):
        return f"{value.__module__}.{value.__qualname__}"
    if inspect.ismethod(value):
        return f"{describe(value.__func__)} of {describe(value.__self__)}"
    if isinstance(value, Mesh):
        devices = ",".join(f"{d.platform}:{d.device_kind}:{d.id}:{d.process_index}" for d in value.devices.flat)
        return f"Mesh({dict(value.shape)}, {value.axis_types}, [{devices}])"
    if isinstance(value, NamedSharding):
        return f"NamedSharding({describe(value.mesh)}, {value.spec}, {value.memory_kind})"
    if isinstance(value, jax.ShapeDtypeStruct):
        return f"{value.shape}:{value.dtype}:{describe(value.sharding)}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = ", ".join(f"{f.name}={describe(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({inner})"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{', '.join(describe(v) for v in value)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{describe(k)}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Enum) or value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    text = repr(value)
    if " at 0x" in text:
        raise TypeError(f"no stable description of a {type(value).__qualname__}: {text}")
    return text


@functools.cache
def source_fingerprint() -> str:
    """A hash of jaxserve's own source files (the traced code, and what decides its arguments)."""
    import jaxserve

    root = Path(jaxserve.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _jax_state() -> str:
    """JAX's version and its configuration's plain values (those that decide how a function traces among them)."""
    plain = (bool, int, float, str, Enum, type(None))
    values = sorted((k, v) for k, v in jax.config.values.items() if isinstance(v, plain))
    return f"{jax.__version__} {jax.lib.__version__} {values}"


def store_folder() -> Path | None:
    """The store's folder, inside JAX's persistent compilation cache; None while that cache is off."""
    cache = jax.config.values.get("jax_compilation_cache_dir")
    if not cache or not jax.config.values.get("jax_enable_compilation_cache", True):
        return None
    return Path(cache) / FOLDER


class ExportStore:
    """Compiles calls through the store in `folder`. `context`: a stable description of everything the calls close
    over (their owner's configuration and mesh)."""

    def __init__(self, folder: Path, context: str):
        self.folder = folder
        self._context = f"{FORMAT} {source_fingerprint()} {_jax_state()} {context}"

    def compile(self, name: str, spec: JitSpec, args: dict[str, Any]) -> jax.stages.Compiled:
        """`spec`'s call compiled for `args` (keyword arguments: ShapeDtypeStructs with shardings, static values)."""
        static = {k: v for k, v in args.items() if k in spec.static_argnames}
        dynamic = {k: v for k, v in args.items() if k not in spec.static_argnames}
        leaves, in_tree = jax.tree.flatten(dynamic)
        key = hashlib.sha256(f"{self._context} {name} {describe(static)} {in_tree} {describe(leaves)}".encode())
        path = self.folder / f"{name}-{key.hexdigest()}.pickle"
        found = self._read(path)
        if found is None:
            serialized, out_tree = self._export(spec, static, leaves, in_tree)
            self._write(path, (serialized, out_tree))
            found = (None if serialized is None else export.deserialize(bytearray(serialized))), out_tree
        exported, out_tree = found
        if exported is None:  # JAX cannot export it (remembered, so that later starts do not try again)
            return spec.jitted.lower(**args).compile()

        def call(**kwargs):
            return jax.tree.unflatten(out_tree, exported.call(*jax.tree.leaves(kwargs)))

        # The call's parameters by name, as the runner passes them (and so that donation finds them by name).
        signature = inspect.signature(spec.fn)
        call.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[p for n, p in signature.parameters.items() if n in dynamic]
        )
        wrapped = jax.jit(
            call,
            donate_argnames=spec.donate_argnames,
            out_shardings=spec.out_shardings,
            compiler_options=dict(spec.compiler_options) or None,
        )
        return wrapped.lower(**dynamic).compile()

    @staticmethod
    def _export(spec: JitSpec, static: dict, leaves: list, in_tree: Any) -> tuple[bytes | None, Any]:
        """The call's program over its flattened arguments, serialized (None if JAX cannot export it), and its
        output's tree."""
        jitted = spec.jitted
        out_tree = None

        def flat(*flat_args):
            nonlocal out_tree
            flat_out, out_tree = jax.tree.flatten(jitted(**jax.tree.unflatten(in_tree, flat_args), **static))
            return flat_out

        try:
            exported = export.export(jax.jit(flat, in_shardings=tuple(leaf.sharding for leaf in leaves)))(*leaves)
        except (ValueError, NotImplementedError) as e:  # a custom call with no stable form (Triton), a host callback
            log.info("%s is traced each start, JAX cannot export it: %s", spec.fn.__qualname__, e)
            return None, None
        return bytes(exported.serialize()), out_tree

    @staticmethod
    def _read(path: Path) -> tuple[export.Exported | None, Any] | None:
        """The entry at `path`: the call's program (None: not exportable) and output tree; None where there is none."""
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            serialized, out_tree = pickle.loads(blob)
            return (None if serialized is None else export.deserialize(bytearray(serialized))), out_tree
        except Exception as e:  # a damaged or foreign entry is traced again and replaced
            log.warning("the exported step %s is unreadable (%s); tracing it again", path.name, e)
            return None

    def _write(self, path: Path, entry: tuple[bytes | None, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: a process reading the entry at the same time sees all of it or none.
        fd, temporary = tempfile.mkstemp(dir=self.folder, suffix=".partial")
        with os.fdopen(fd, "wb") as out:
            pickle.dump(entry, out)
        os.replace(temporary, path)
