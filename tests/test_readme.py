"""Every Python code block of README.md runs as written (a fresh interpreter each, default
model), so a README edit that breaks a snippet fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / ".ci"))
import readme  # the README reader CI uses too

BLOCKS = readme.python_blocks()


def test_readme_has_the_python_blocks_it_advertises():
    assert len(BLOCKS) >= 5
    assert all("import" in block for block in BLOCKS)  # self-contained, not fragments


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(block, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "a README snippet should print what it shows"


def test_readme_commands_are_read_from_the_readme():
    """CI runs exactly these: the set-up line(s), one test command, and the Run-it block,
    each of which has an expected output written down."""
    assert readme.setup_commands() and all(
        "pip install" in c or "paged-backend" in c for c in readme.setup_commands()
    )
    assert readme.test_command().startswith("python -m pytest")
    for command in readme.commands("Run it"):
        assert any(command.startswith(key) for key in readme.EXPECTED), command
