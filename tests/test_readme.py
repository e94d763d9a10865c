"""The README's quick start, run as a newcomer would: every command block of its `## Quick start` section, in a
fresh clone (of this checkout's last commit) with a fresh venv, the serve command in the background until ready.

The one change to the commands: port 8000 becomes a free port, since a test machine may serve something on 8000.
pip's own cache (and the environment's pip configuration) is used, as a newcomer's pip would; the venv is new, so
this test pays a whole `pip install` of jax and its dependencies, and, with a cold JAX compile cache, the first
start's compile.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Left out of the children's environment: what the test run itself set up (8 fake devices, this venv).
TEST_ONLY_ENV = ("XLA_FLAGS", "JAX_PLATFORMS", "VIRTUAL_ENV", "PYTHONPATH", "JAXSERVE_COMPILE_CACHE")


def quick_start_blocks(readme: str) -> list[str]:
    section = readme.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_readme_quick_start_from_a_fresh_clone(tmp_path):
    if not (REPO / ".git").exists() or shutil.which("git") is None or shutil.which("curl") is None:
        pytest.skip("needs a git checkout, git and curl")
    clone = tmp_path / "jaxserve"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    blocks = quick_start_blocks((clone / "README.md").read_text())
    assert len(blocks) == 2 and "jaxserve --port 8000" in blocks[0], blocks
    port = str(free_port())
    serve_block, query_block = (block.replace("8000", port) for block in blocks)
    env = {key: value for key, value in os.environ.items() if key not in TEST_ONLY_ENV}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if Path(p) != Path(sys.executable).parent
    )  # not this test run's venv

    started = time.monotonic()
    server = subprocess.Popen(
        ["bash", "-ec", serve_block], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = []
    try:
        for line in server.stdout:
            output.append(line)
            if line.startswith(f"jaxserve ready on http://127.0.0.1:{port}"):
                break
        else:
            raise AssertionError(f"the serve block ended without serving:\n{''.join(output)[-3000:]}")
        ready = time.monotonic() - started
        query = subprocess.run(
            ["bash", "-ec", query_block], cwd=clone, env=env, capture_output=True, text=True, timeout=600
        )
        assert query.returncode == 0, query.stdout[-2000:] + query.stderr[-2000:]
        # curl's JSON (no newline after it), then the openai client's text (the trained default's continuation).
        completion, end = json.JSONDecoder().raw_decode(query.stdout)
        assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 16
        assert query.stdout[end:].strip(), query.stdout + query.stderr
    finally:
        # SIGTERM to jaxserve, bash's child (or bash itself, if bash ran the last command in its place); bash then
        # exits with jaxserve's status.
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children")
        for pid in (children.read_text().split() if children.exists() else []) or [server.pid]:
            os.kill(int(pid), signal.SIGTERM)
        status = server.wait(timeout=120)
    print(
        f"README quick start: ready {ready:.0f} s after the first command, all blocks {time.monotonic() - started:.0f}"
        f" s"
    )
    assert status == 0, "".join(output)[-3000:]
