"""compiling.py's start-up check: torch.compile on CUDA needs a C compiler at run time (Triton
builds its kernel launchers with one); without it the engine's compiled functions run eagerly,
and the server says so once, before any request pays for it."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest
import torch
from rollserve.server.generation import compiling
from rollserve.server.generation.compiling import COMPILE_ENV, c_compiler, compiles_by_default


def _executable(directory: Path, name: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def bare_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH of one empty directory and no $CC: no compiler anywhere."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    compiling._check_c_compiler.cache_clear()
    return tmp_path


def test_the_compiler_is_found_as_triton_finds_it(
    bare_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert c_compiler() is None
    clang = _executable(bare_path, "clang")
    assert c_compiler() == str(clang)
    gcc = _executable(bare_path, "gcc")
    assert c_compiler() == str(gcc)  # gcc before clang
    named = _executable(bare_path, "cc-14")
    monkeypatch.setenv("CC", "cc-14")
    assert c_compiler() == str(named)  # $CC before both
    monkeypatch.setenv("CC", "no-such-cc")
    assert c_compiler() is None  # a $CC that is not there: Triton would fail on it


def test_a_cuda_engine_without_a_compiler_is_told_once(
    bare_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    cuda = torch.device("cuda")  # a device name only: nothing runs on it
    with caplog.at_level(logging.WARNING, logger="rollserve.generation"):
        assert compiles_by_default(torch.device("cpu")) is False
        assert not caplog.records  # the CPU never compiles by default: nothing to say
        assert compiles_by_default(cuda) is True  # still tries: a compiler may come later
        assert compiles_by_default(cuda) is True
    (record,) = caplog.records
    assert "no C compiler" in record.getMessage() and COMPILE_ENV in record.getMessage()
    caplog.clear()
    _executable(bare_path, "gcc")
    compiling._check_c_compiler.cache_clear()
    with caplog.at_level(logging.WARNING, logger="rollserve.generation"):
        assert compiles_by_default(cuda) is True
        monkeypatch.setenv(COMPILE_ENV, "0")
        assert compiles_by_default(cuda) is False
    assert not caplog.records
