"""Compiled steps kept on disk under what they are compiled from, so that a warm start skips tracing and lowering.

JAX's persistent compilation cache keeps XLA's compile, but JAX traces and lowers a step to find its entry; for the
small models of the tests and the CPU benchmarks that is most of a warm start (the speculative tests' four runners:
about 26 of their 33 s of set-up, in Python tracing the layers). The store's key is known before tracing: a digest of
the code that traces (every source file of the `jaxserve` and `jaxserve.kernels` packages), the JAX build and its
settings (XLA_FLAGS, the jax config's plain values), the devices, what the caller says the step computes (the model's
config, the cache geometry, the kernels) and the call's abstract arguments with their shardings. Any change to one of
them is another key; nothing is ever looked up by a stale one.

The store lives beside JAX's cache (`jax_compilation_cache_dir`/jaxserve-steps): without that cache, or with it off,
there is no store. It serves one process's own devices only (not a multi-process group, not a deviceless target).
An entry that cannot be read back is compiled again and rewritten; one that cannot be written is only compiled; a
call JAX's own cache had is not stored (XLA:CPU cannot serialize it again), so the store fills as steps are
compiled afresh (a cold cache, changed code).
Loading an entry runs the machine code in it: the store is as trusted as the cache folder (JAX's own cache holds
compiled code the same way).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.experimental.serialize_executable import deserialize_and_load, serialize

log = logging.getLogger(__name__)

FOLDER = "jaxserve-steps"

# Whether the compile this thread is in came from JAX's persistent cache: XLA:CPU cannot serialize such an executable
# again (loaded back, it fails at its first call: "Function ... not found"), so only fresh compiles are stored.
_compile = threading.local()


def _note_cache_hit(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _compile.from_jax_cache = True


jax.monitoring.register_event_listener(_note_cache_hit)


@functools.cache
def code_fingerprint() -> str:
    """A digest of the source of every module that can take part in tracing a step, and of the JAX build."""
    import jaxlib

    import jaxserve
    import jaxserve.kernels

    digest = hashlib.sha256(f"jax {jax.__version__} jaxlib {jaxlib.__version__}".encode())
    for package in (jaxserve, jaxserve.kernels):
        for root in map(Path, package.__path__):
            for path in sorted(root.rglob("*.py")):
                digest.update(f"{package.__name__}/{path.relative_to(root)}".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def describe_callable(fn: Callable) -> str:
    """A kernel or function by what it is: its qualified name, with a partial's arguments."""
    if isinstance(fn, functools.partial):
        return f"partial({describe_callable(fn.func)}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _settings() -> str:
    """What besides the code decides how JAX and XLA compile here: XLA_FLAGS and the jax config's plain values."""
    plain = (str, int, float, bool, type(None))
    values = sorted((k, v) for k, v in jax.config.values.items() if isinstance(v, plain))
    return repr((os.environ.get("XLA_FLAGS", ""), values))


def _describe_args(args: dict[str, Any]) -> str:
    leaves, tree = jax.tree.flatten(args)
    described = [
        (leaf.shape, str(leaf.dtype), repr(getattr(leaf, "sharding", None)))
        if isinstance(leaf, jax.ShapeDtypeStruct)
        else repr(leaf)
        for leaf in leaves
    ]
    return repr((str(tree), described))


class ExecutableStore:
    """Compiled calls by key, in one folder; `loaded` and `stored` count this store's reads and writes."""

    def __init__(self, folder: Path, devices: list[Any], describe: str):
        self.folder = folder
        self.devices = devices  # the mesh's devices, in its order: where a loaded call runs
        self.describe = describe  # those devices and the backend's version: part of every key
        self.loaded = 0
        self.stored = 0

    @classmethod
    def for_mesh(cls, mesh: jax.sharding.Mesh) -> ExecutableStore | None:
        """The store for steps on `mesh`: None without JAX's persistent cache, in a multi-process group, or for
        devices this process cannot run (a deviceless target)."""
        cache_dir = jax.config.values.get("jax_compilation_cache_dir")
        if not cache_dir or not jax.config.values.get("jax_enable_compilation_cache", True):
            return None
        if jax.process_count() > 1 or not set(mesh.devices.flat) <= set(jax.local_devices()):
            return None
        devices = list(mesh.devices.flat)
        described = [(d.platform, d.device_kind, d.id) for d in devices]
        platform_version = devices[0].client.platform_version
        return cls(
            Path(cache_dir) / FOLDER,
            devices,
            repr((mesh.axis_names, mesh.devices.shape, described, platform_version)),
        )

    def key(self, name: str, context: str, args: dict[str, Any]) -> str:
        parts = (code_fingerprint(), _settings(), self.describe, name, context, _describe_args(args))
        return hashlib.sha256(repr(parts).encode()).hexdigest()

    def compiled(self, jitted: Any, name: str, context: str, args: dict[str, Any]) -> jax.stages.Compiled:
        """`jitted` compiled for `args` (keyword arguments, as it is called), from the store if it has it. `name`
        and `context` say what `jitted` computes beyond its arguments (its function, the model, the kernels)."""
        path = self.folder / f"{self.key(name, context, args)}.exe"
        if path.exists():
            try:
                payload, in_tree, out_tree = pickle.loads(zlib.decompress(path.read_bytes()))
                compiled = deserialize_and_load(payload, in_tree, out_tree, execution_devices=self.devices)
                self.loaded += 1
                return compiled
            except Exception as error:  # noqa: BLE001 - a bad entry is compiled again, never fatal
                log.warning("compiled step %s unreadable (%s); compiling it again", path.name, error)
        _compile.from_jax_cache = False
        compiled = jitted.lower(**args).compile()
        if _compile.from_jax_cache:
            log.debug("compiled step %s (%s) came from JAX's cache: not stored", path.name, name)
            return compiled  # not storable (above); the next compile from fresh is
        try:
            # XLA:CPU's machine code shrinks about 5x at zlib's fastest level, in about 20 ms a step
            blob = zlib.compress(pickle.dumps(serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL), 1)
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, part = tempfile.mkstemp(dir=self.folder, suffix=".part")
            try:
                with os.fdopen(handle, "wb") as out:
                    out.write(blob)
                os.replace(part, path)  # whole or not at all, even with other processes writing the same key
            except BaseException:
                Path(part).unlink(missing_ok=True)
                raise
            self.stored += 1
        except Exception as error:  # noqa: BLE001 - the step is compiled; keeping it is an optimisation
            # XLA:CPU cannot serialize some calls (a sort's comparator: "`LessThan` is not serializable")
            log.debug("compiled step %s (%s) not stored: %s", path.name, name, error)
        return compiled
