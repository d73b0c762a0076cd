"""torch.compile for the engine's pure functions (the decode step's, and the full-sequence
layer's of prefill and scoring), with the eager function as fallback.

Compilation happens on a function's first call for a shape (the eager warm-up run before a
CUDA graph is captured). A compiler failure there (an Inductor bug for some shape) must not
fail the request: the function falls back to eager for good, and says so in the log.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from .switches import env_choice

__all__ = [
    "COMPILE_ENV",
    "CPP_WRAPPER_ENV",
    "c_compiler",
    "compiles_by_default",
    "cpp_wrapper_missing",
    "eager_fallbacks",
    "full_sequence_options",
    "maybe_compiled",
]

_log = logging.getLogger("rollserve.generation")
COMPILE_ENV = "ROLLSERVE_ENGINE_COMPILE"  # "0": run the engine's functions eagerly
# "1": the full-sequence layer functions (prefill, scoring) compiled with Inductor's C++ wrapper
# (`full_sequence_options`); "0" or unset: its Python wrapper.
CPP_WRAPPER_ENV = "ROLLSERVE_ENGINE_CPP_WRAPPER"
# Compiled versions kept per function before dynamo silently runs it eagerly. A function here
# compiles once per (sampling structure, batch-size class: the first size, dynamic, 1), so
# dynamo's default of 8 would turn the sampler eager after a few kinds of requests.
RECOMPILE_LIMIT = 64


def _raise_recompile_limit() -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across versions
        if hasattr(config, name):
            setattr(config, name, max(int(getattr(config, name)), RECOMPILE_LIMIT))
            return


# Qualified names of the functions whose compile failed and that run eagerly since: Health's
# eager_fallbacks (a set's add is atomic: any thread may fail a compile).
_FALLBACKS: set[str] = set()


def eager_fallbacks() -> tuple[str, ...]:
    """The functions of this process that torch.compile failed on and that run eagerly since
    (maybe_compiled's fallback), sorted by name."""
    return tuple(sorted(_FALLBACKS))


class _Compiled:
    """A torch.compile'd function that turns into the eager one after a compiler failure."""

    def __init__(
        self,
        fn: Callable[..., Any],
        dynamic: bool | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.eager = fn
        _raise_recompile_limit()
        self.compiled: Callable[..., Any] | None = torch.compile(
            fn, fullgraph=True, dynamic=dynamic, options=options
        )

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as error:  # noqa: BLE001 - any compiler failure: run eager
                if _a_run_failed(error):
                    raise
                name = str(getattr(self.eager, "__qualname__", self.eager))
                _log.warning(
                    "torch.compile of %s failed (%s: %s); running it eagerly", name,
                    type(error).__name__, str(error).splitlines()[0] if str(error) else "",
                )  # fmt: skip
                _FALLBACKS.add(name)
                self.compiled = None
        return self.eager(*args)


def _a_run_failed(error: Exception) -> bool:
    """Whether `error` is the compiled code failing to run, not the compiler failing to build
    it: out of device memory (a large batch: the caller decides; eager would need as much),
    or raised inside a CUDA graph capture (the capture failed: eager cannot be captured
    either). The function keeps its compiled code."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    # is_initialized: a CPU model's failure must not start CUDA (a context on the GPU) to ask.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def maybe_compiled(
    fn: Callable[..., Any],
    enabled: bool,
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    """fn compiled when enabled (falling back to fn on a compiler failure), else fn. dynamic:
    torch.compile's (True: one code for every size of the inputs' dimensions, except sizes
    0 and 1, which dynamo specialises); options: Inductor's, for this function. torch.compile
    keeps one backend's code per code object: a function compiled with two sets of options
    compiles again at every switch between them, so each set needs a function of its own."""
    return _Compiled(fn, dynamic, options) if enabled else fn


def full_sequence_options(device: torch.device) -> dict[str, Any] | None:
    """Inductor's options for the full-sequence layer functions (model.Forward's
    `_token_inputs`, `_token_mlp`) on `device`: its C++ wrapper when
    ROLLSERVE_ENGINE_CPP_WRAPPER=1 and this host can build it (`cpp_wrapper_missing`; if not,
    a warning once and None), else None (its Python wrapper); ValueError for another value.

    Why a switch: a compiled call's host time is its wrapper launching each kernel (a
    scoring forward batch was host-bound on an H200, ~30 % of it idle); the C++ wrapper
    launches them without Python. On this project's 2-core CPU it took the host proxy of that
    batch (bench/bench_forward_host.py's call structure) from 44.7 to 40.6 ms a forward
    (medians; minimums 31.4 / 25.9), for ~15 s more compiling per function (a C++ build).
    Never run on a GPU: bench/profile_gpu.py's last part measures it ("Scoring body, C++
    wrapper"). Why the check: a build that fails at the first call turns the function eager
    for good (maybe_compiled), several times slower than the Python wrapper it was to beat."""
    on = env_choice(CPP_WRAPPER_ENV, ("0", "1"), "0") == "1"
    if not on:
        return None
    missing = cpp_wrapper_missing(device.type)
    if missing is not None:
        _warn_cpp_wrapper_missing(missing)
        return None
    return {"cpp_wrapper": True}


@functools.cache
def cpp_wrapper_missing(device_type: str) -> str | None:
    """What this host lacks for Inductor's C++ wrapper on `device_type`, as Inductor looks for
    it (None: nothing): a C++ compiler ($CXX, else g++ on PATH: the Docker image installs
    only gcc), and for CUDA the toolkit's headers and libraries (torch.utils.cpp_extension's
    CUDA_HOME: $CUDA_HOME or $CUDA_PATH, nvcc on PATH, /usr/local/cuda), which its CUDA
    build includes and links (pip's torch wheels ship neither). Looked up once a process."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}: $CXX, else g++) on PATH"
    if device_type == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            return "no CUDA toolkit ($CUDA_HOME, nvcc on PATH or /usr/local/cuda)"
    return None


@functools.cache
def _warn_cpp_wrapper_missing(missing: str) -> None:
    _log.warning(
        "%s=1 ignored: Inductor's C++ wrapper cannot be built here (%s); the full-sequence "
        "functions keep the Python wrapper",
        CPP_WRAPPER_ENV,
        missing,
    )


def compiles_by_default(device: torch.device) -> bool:
    """Whether the engine's forward compiles its functions on `device` unless told: on CUDA
    (there they are bound by small kernels; elsewhere compile time outweighs the gain),
    unless ROLLSERVE_ENGINE_COMPILE=0."""
    compiles = device.type == "cuda" and os.environ.get(COMPILE_ENV, "1") != "0"
    if compiles:
        _check_c_compiler()
    return compiles


def c_compiler() -> str | None:
    """The C compiler Triton (torch.compile's CUDA backend) builds its kernel launchers with,
    found as Triton finds it: $CC, else gcc, else clang on PATH; None without one."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return shutil.which("gcc") or shutil.which("clang")


@functools.cache
def _check_c_compiler() -> None:
    """Once a process (PATH is looked through once, at the first engine's start): without a C
    compiler, say what it will cost: every compiled function fails its first call and runs
    eager for good (several times slower on a GPU)."""
    if c_compiler() is not None:
        return
    _log.warning(
        "no C compiler ($CC, gcc or clang) on PATH: Triton cannot build the kernels of "
        "torch.compile, so the engine's compiled functions will run eagerly, several times "
        "slower; install gcc and the libc headers (the Dockerfile does), or set %s=0 to skip "
        "compiling",
        COMPILE_ENV,
    )
