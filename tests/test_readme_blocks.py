"""Every Python block of the README runs as written when copied alone (issue 34, point 6): each CPU block in a fresh
interpreter in an empty folder; the blocks that say they need `diffgraph serve --model digits` against one such
server (their 127.0.0.1:8000 pointed at it); the blocks that say they need a GPU are only checked to say so."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diffgraph.server.process import ServerProcess

README = Path(__file__).resolve().parents[1] / "README.md"
SERVER = "# with `diffgraph serve --model digits` running"
GPU = "# on a GPU"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _kind(block: str) -> str:
    first = block.splitlines()[0]
    return "server" if first.startswith(SERVER) else "gpu" if first.startswith(GPU) else "cpu"


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


def test_the_readme_has_python_blocks_of_each_kind():
    kinds = [_kind(b) for b in BLOCKS]
    assert kinds.count("cpu") >= 5 and kinds.count("server") >= 2 and kinds.count("gpu") >= 1, kinds
    for block in BLOCKS:  # nothing relies on a variable another block made
        if _kind(block) == "cpu":
            assert "Engine(" in block or "import" in block.splitlines()[0], block[:80]


@pytest.mark.parametrize("index", [i for i, b in enumerate(BLOCKS) if _kind(b) == "cpu"])
def test_a_cpu_block_runs_alone(index, tmp_path):
    proc = _run(BLOCKS[index], tmp_path)
    assert proc.returncode == 0, f"README block {index} failed:\n{BLOCKS[index]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--request-timeout", "600", model="digits")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop(timeout=30)


@pytest.mark.parametrize("index", [i for i, b in enumerate(BLOCKS) if _kind(b) == "server"])
def test_a_server_block_runs_alone_against_a_server(index, server, tmp_path):
    proc = _run(BLOCKS[index].replace("http://127.0.0.1:8000", server.url), tmp_path)
    assert proc.returncode == 0, f"README block {index} failed:\n{BLOCKS[index]}\n{proc.stderr[-3000:]}"
    assert any(f.suffix == ".png" for f in tmp_path.iterdir())  # it wrote its images
