"""Test set-up: 8 fake CPU devices and JAX's persistent compilation cache, both before JAX starts."""

import gc
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (imported, its backend not started: XLA_FLAGS is read when the first one starts)
import pytest  # noqa: E402

from jaxserve.runner.targets import ask_for_cost_model  # noqa: E402

# GPU compiles here are deviceless (jaxserve.runner.targets) and read XLA's cost models.
ask_for_cost_model()

# The suite's workers (pytest-xdist, pyproject.toml) share the cache: an entry read while another worker still writes
# it fails to decompress, and jax then compiles it (a warning), so the sharing costs at most a compile.
_CACHE = os.environ.get("JAXSERVE_TEST_COMPILE_CACHE", str(Path.home() / ".cache" / "jaxserve" / "xla-tests"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

sys.path.insert(0, str(Path(__file__).parent))  # the test helpers (reference.py, harness.py)


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A CLI command run in-process sets up the root logger (basicConfig(force=True)) on the test's captured stderr,
    which pytest closes after the test: later tests' log lines then went to a closed file ("Logging error")."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:], root.level = handlers, level


@pytest.fixture(autouse=True, scope="module")
def _executables_released():
    """Each live XLA:CPU executable keeps its JIT code in a few anonymous memory mappings; in one process the whole
    suite's executables passed the kernel's vm.max_map_count (65530) and compiling the next one aborted or segfaulted
    in XLA (CI, ~690 tests in). A finished module's runners and jit caches are let go here, so that maps and memory
    stay within one module's needs."""
    yield
    jax.clear_caches()
    gc.collect()
