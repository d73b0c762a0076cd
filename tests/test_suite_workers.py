"""`make test` runs the suite with `-n auto`: tests/conftest.py decides how many workers that is
(the cores this process may use, capped), and xdist's own variable still overrides it."""

from __future__ import annotations

import os

import conftest
import pytest


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (2, 2), (3, 3), (64, 4)])
def test_auto_is_a_worker_per_usable_core_up_to_the_cap(
    monkeypatch: pytest.MonkeyPatch, cores: int, workers: int
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert conftest.MAX_TEST_WORKERS == 4
    assert conftest.pytest_xdist_auto_num_workers(None) == workers


def test_the_xdist_variable_overrides_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "7")
    assert conftest.pytest_xdist_auto_num_workers(None) == 7
