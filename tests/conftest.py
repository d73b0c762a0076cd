"""Shared fixtures and the two machine knobs of the suite.

- Tiny real transformers models saved to temp dirs (built once per session).
- The `gpu` marker: every item marked `gpu` is skipped here, in one place, when torch sees no
  CUDA device. GPU tests carry only `@pytest.mark.gpu`; `make test-gpu` runs just them.
- ROLLSERVE_TEST_CPU_COUNT=N runs the suite as if `os.cpu_count()` returned N, so a 2-core
  machine checks what a 16-core node decides from its core count (parallel gRPC streams,
  shared-memory copy lanes). It is patched in this process for the session and, through a
  `sitecustomize` put first on PYTHONPATH, in every Python subprocess the tests start (server
  processes, example trainers); a test that replaces PYTHONPATH for its subprocess opts out.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

CPU_COUNT_VARIABLE = "ROLLSERVE_TEST_CPU_COUNT"

# Runs at the start of every Python subprocess that inherits the PYTHONPATH set below. It then
# runs the sitecustomize that it shadows, if the interpreter has one.
_SITECUSTOMIZE = '''\
"""Written by tests/conftest.py for {variable}: os.cpu_count() returns {count}."""
import importlib.machinery
import importlib.util
import os
import sys

os.cpu_count = lambda: {count}
_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


def _simulated_cpu_count() -> int | None:
    text = os.environ.get(CPU_COUNT_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise pytest.UsageError(f"{CPU_COUNT_VARIABLE} must be a positive integer, got {text!r}")
    return int(text)


def _patch_subprocesses(count: int) -> Callable[[], None]:
    """Put a sitecustomize that patches os.cpu_count first on PYTHONPATH; returns the undo."""
    folder = tempfile.mkdtemp(prefix="rollserve-cpu-count-")
    Path(folder, "sitecustomize.py").write_text(
        _SITECUSTOMIZE.format(variable=CPU_COUNT_VARIABLE, count=count)
    )
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, previous) if p)

    def undo() -> None:
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous
        shutil.rmtree(folder, ignore_errors=True)

    return undo


def pytest_configure(config: pytest.Config) -> None:
    # Before any test module imports rollserve: a few module constants read the core count.
    count = _simulated_cpu_count()
    if count is None:
        return
    real = os.cpu_count
    os.cpu_count = lambda: count
    config.add_cleanup(lambda: setattr(os, "cpu_count", real))
    config.add_cleanup(_patch_subprocesses(count))


# `make test` runs `-n auto`: a worker per core the process may use, at most this many. Past a
# few workers the longest test files set the wall time, while every worker adds a process with
# torch and transformers loaded, and its tests' server processes, to the machine's memory.
MAX_TEST_WORKERS = 4


# optionalhook: without pytest-xdist (a GPU node's python, `make test-gpu`) the hook is unknown,
# and pytest would refuse the conftest.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pytest-xdist): the cores this process may run on (the real ones, not
    ROLLSERVE_TEST_CPU_COUNT's), at most MAX_TEST_WORKERS; none (the suite in this process)
    where there is a GPU; PYTEST_XDIST_AUTO_NUM_WORKERS, as xdist documents it, decides when
    set."""
    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").strip()
    if chosen.isdigit():
        return int(chosen)
    if gpu_present():
        return 0  # in this process, as `-n 0`: the gpu tests share the device and read its memory
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_TEST_WORKERS))


def gpu_present() -> bool:
    """Whether torch sees a GPU; torch is imported only where a GPU driver is (the `-n auto`
    decision runs before any test module imports it)."""
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")):
        return False
    import torch

    return torch.cuda.is_available()


def pytest_report_header(config: pytest.Config) -> str | None:
    count = _simulated_cpu_count()
    if count is None:
        return None
    return f"os.cpu_count() patched to {count} ({CPU_COUNT_VARIABLE}), also in subprocesses"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every `gpu` item when there is no CUDA device: the one place that decides."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random LlamaForCausalLM + byte tokenizer, saved with save_pretrained."""
    from rollserve.server.models.default_model import save_tiny_causal_lm

    return save_tiny_causal_lm(tmp_path_factory.mktemp("actor"))


@pytest.fixture(scope="session")
def tiny_critic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollserve.server.models.default_model import save_tiny_scalar_head

    return save_tiny_scalar_head(tmp_path_factory.mktemp("critic"), "critic")


@pytest.fixture(scope="session")
def tiny_reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollserve.server.models.default_model import save_tiny_scalar_head

    return save_tiny_scalar_head(tmp_path_factory.mktemp("reward"), "reward")
