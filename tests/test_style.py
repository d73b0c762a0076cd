"""`ruff format` clean over the whole tree (issue 13), with the ruff the dev extra pins."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> str:
    """The ruff next to this interpreter (the venv's) or on PATH, if it is the pinned version."""
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = next(re.sub(r"^ruff==", "", d) for d in pins["dev"] if d.startswith("ruff=="))
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    version = subprocess.run([ruff, "--version"], capture_output=True, text=True).stdout.split()
    if version[-1] != pinned:  # formatter output changes between releases
        pytest.skip(f"ruff {version[-1]} is not the pinned {pinned}")
    return ruff


def test_tree_is_ruff_format_clean() -> None:
    result = subprocess.run(
        [_ruff(), "format", "--check", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"run `ruff format` on:\n{result.stdout}{result.stderr}"
