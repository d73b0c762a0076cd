"""compiling.py's start-up checks: torch.compile on CUDA needs a C compiler at run time (Triton
builds its kernel launchers with one); without it the engine's compiled functions run eagerly,
and the server says so once, before any request pays for it. Inductor's C++ wrapper
(ROLLSERVE_ENGINE_CPP_WRAPPER=1) needs a C++ compiler, and on CUDA the CUDA toolkit: where one
is missing the switch is ignored, with a warning, rather than every full-sequence function
failing its build and running eagerly for good."""

from __future__ import annotations

import logging
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rollserve.server.generation import compiling
from rollserve.server.generation.compiling import (
    COMPILE_ENV,
    CPP_WRAPPER_ENV,
    c_compiler,
    compiles_by_default,
    cpp_wrapper_missing,
    full_sequence_options,
)


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


@pytest.fixture
def cpp_lookups() -> Iterator[None]:
    """cpp_wrapper_missing and its warning are looked up once a process: anew for each test."""
    compiling.cpp_wrapper_missing.cache_clear()
    compiling._warn_cpp_wrapper_missing.cache_clear()
    yield
    compiling.cpp_wrapper_missing.cache_clear()
    compiling._warn_cpp_wrapper_missing.cache_clear()


def test_the_cpp_wrapper_needs_a_cpp_compiler_and_on_cuda_the_toolkit(
    bare_path: Path, cpp_lookups: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils import cpp_extension

    monkeypatch.delenv("CXX", raising=False)
    assert "no C++ compiler (g++" in str(cpp_wrapper_missing("cpu"))
    _executable(bare_path, "g++")
    compiling.cpp_wrapper_missing.cache_clear()
    assert cpp_wrapper_missing("cpu") is None
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert "no CUDA toolkit" in str(cpp_wrapper_missing("cuda"))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(bare_path))
    compiling.cpp_wrapper_missing.cache_clear()
    assert cpp_wrapper_missing("cuda") is None
    monkeypatch.setenv("CXX", "clang++-19")  # $CXX before g++, as Inductor looks
    compiling.cpp_wrapper_missing.cache_clear()
    assert "clang++-19" in str(cpp_wrapper_missing("cpu"))


def test_the_cpp_wrapper_switch_is_ignored_with_a_warning_where_it_cannot_be_built(
    bare_path: Path,
    cpp_lookups: None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CXX", raising=False)
    cpu = torch.device("cpu")
    monkeypatch.delenv(CPP_WRAPPER_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="rollserve.generation"):
        assert full_sequence_options(cpu) is None  # off: nothing looked up, nothing said
        monkeypatch.setenv(CPP_WRAPPER_ENV, "1")
        assert full_sequence_options(cpu) is None  # no g++ on this PATH
        assert full_sequence_options(cpu) is None
    (record,) = caplog.records  # once
    assert CPP_WRAPPER_ENV in record.getMessage() and "no C++ compiler" in record.getMessage()
    _executable(bare_path, "g++")
    compiling.cpp_wrapper_missing.cache_clear()
    assert full_sequence_options(cpu) == {"cpp_wrapper": True}
