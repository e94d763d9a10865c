"""The runner of the embedded default checkpoint under a small engine config, built and warmed up once per test session
and shared by the modules that serve it (test_server, test_logprobs, test_structured_outputs, test_lm_eval; conftest.py
keeps them on one pytest-xdist worker). Engines on one runner must not run steps at the same time: each test keeps all
but one of its engines idle (the runner's cache belongs to whoever steps)."""

from __future__ import annotations

import pytest

from jaxserve.checkpoints.load import load_model
from jaxserve.config import EngineConfig
from jaxserve.model.sharding import make_mesh
from jaxserve.runner import build_runner

# Small on purpose: 2 prefill + 3 decode shapes to compile. tests/test_cli.py serves with the same flags, so
# its subprocess finds these shapes in the persistent compilation cache.
CONFIG = EngineConfig(
    dtype="float32",
    max_num_seqs=4,
    chunked_prefill_size=64,
    max_prefill_rows=1,
    page_size=16,
    max_model_len=256,
    max_queued_requests=64,
    decode_log_interval=1000,
    mixed_batches=False,  # as tests/test_cli.py's flags; mixed steps have their own tests (tests/test_engine.py)
)
MODEL = "tiny-v4"


@pytest.fixture(scope="session")
def loaded():
    return load_model(None, make_mesh(1, 1), dtype=CONFIG.dtype)


@pytest.fixture(scope="session")
def runner(loaded):
    runner = build_runner(CONFIG, loaded.config, loaded.weights, make_mesh(1, 1))
    runner.warmup()
    return runner
