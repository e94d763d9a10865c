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
from xdist.scheduler import LoadScopeScheduling  # noqa: E402

from jaxserve.runner.targets import CHEAP_CPU_COMPILE_FLAGS, add_xla_flags, ask_for_cost_model  # noqa: E402

# GPU compiles here are deviceless (jaxserve.runner.targets) and read XLA's cost models.
ask_for_cost_model()
# Compiling tiny models' steps takes most of the suite's time, running them little: XLA:CPU compiles cheaply here (the
# same fusions, less optimized machine code). The child processes the tests start inherit it.
add_xla_flags(*CHEAP_CPU_COMPILE_FLAGS)

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


pytest_plugins = ["served_runner"]  # the session's shared runner of the embedded default checkpoint

# The modules that share tests/served_runner.py's runner: one work unit, so it is built once.
SERVED_RUNNER_GROUP = ("test_server.py", "test_logprobs.py", "test_structured_outputs.py", "test_lm_eval.py")

# The work units that take a worker half a minute or more in a warm run of the whole suite on 2 cores, in the order
# they start. pytest-xdist hands each worker whole work units (WorkUnitScheduling: a module, or the group above), by
# default ordered by their number of tests, which sent these minute-long ones with few tests last, one worker running
# them alone at the end; they go first instead (--no-loadscope-reorder in pyproject.toml), the rest after them in
# file order. Longest first, but those that run servers or process groups in subprocesses (cli, multiprocess, readme,
# gpu_roofline, default_checkpoint) alternate with those that compute in the worker: two of them at once oversubscribed
# the 2 cores and each took half as long again. Each worker starts with two units: cli and multiprocess go to one.
STARTED_FIRST = (
    "test_cli.py",  # ~105 s, subprocesses
    "test_speculative.py",  # ~85 s
    "test_multiprocess.py",  # ~105 s, subprocesses
    "test_disaggregation.py",  # ~60 s, subprocesses
    "served_runner",  # ~60 s
    "test_readme.py",  # ~45 s, a subprocess pip install
    "test_plan_target.py",  # ~65 s
    "test_gpu_roofline.py",  # ~36 s, a subprocess
    "test_kv_fp8.py",  # ~50 s
    "test_default_checkpoint.py",  # ~35 s, a subprocess
    "test_quantized_weights.py",  # ~35 s
    "test_vocab_padding.py",  # ~35 s
    "test_model_parity.py",  # ~30 s
    "test_runner.py",  # ~30 s
)


def _work_unit(nodeid: str) -> str:
    """'tests/test_server.py::test_x[a]' -> 'served_runner'; any other test's unit is its module's file name."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return "served_runner" if module in SERVED_RUNNER_GROUP else module


class WorkUnitScheduling(LoadScopeScheduling):
    """pytest-xdist's loadscope, its scopes our work units. Not `--dist loadgroup` with xdist_group marks: xdist 3.8
    groups by rewriting each test's node id, which pytest 9.2's node ids ignore, so every test went out alone and
    each worker that got one of a module's tests set the module's fixtures up again (pytest-xdist issue 1386)."""

    def _split_scope(self, nodeid: str) -> str:
        return _work_unit(nodeid)


def pytest_xdist_make_scheduler(config, log):
    return WorkUnitScheduling(config, log)


def pytest_collection_modifyitems(items):
    """The units of STARTED_FIRST first, in its order; the order within a unit stays. Every worker sorts its
    collection the same way, as xdist requires."""
    first = {unit: rank for rank, unit in enumerate(STARTED_FIRST)}
    items.sort(key=lambda item: first.get(_work_unit(item.nodeid), len(first)))  # a stable sort
