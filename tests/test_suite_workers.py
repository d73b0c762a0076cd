"""`make test` runs the suite with `-n auto`: tests/conftest.py decides how many workers that is
(the cores this process may use, capped; none with a GPU), and xdist's own variable still
overrides it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import conftest
import pytest


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (2, 2), (3, 3), (64, 4)])
def test_auto_is_a_worker_per_usable_core_up_to_the_cap(
    monkeypatch: pytest.MonkeyPatch, cores: int, workers: int
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(conftest, "gpu_present", lambda: False)
    assert conftest.MAX_TEST_WORKERS == 4
    assert conftest.pytest_xdist_auto_num_workers(None) == workers


def test_with_a_gpu_the_suite_runs_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gpu tests share the device and read its free memory: no parallel workers there."""
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(conftest, "gpu_present", lambda: True)
    assert conftest.pytest_xdist_auto_num_workers(None) == 0


def test_the_xdist_variable_overrides_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "7")
    assert conftest.pytest_xdist_auto_num_workers(None) == 7


def test_the_suite_runs_without_xdist() -> None:
    """A python without pytest-xdist (the GPU node's, `make test-gpu`) still takes the conftest."""
    tests = Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         str(tests / "test_suite_workers.py"), "-k", "cap"],
        capture_output=True, text=True, timeout=120, cwd=tests.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout, result.stdout
