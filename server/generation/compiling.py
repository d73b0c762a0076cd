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

__all__ = ["COMPILE_ENV", "c_compiler", "compiles_by_default", "maybe_compiled"]

_log = logging.getLogger("rollserve.generation")
COMPILE_ENV = "ROLLSERVE_ENGINE_COMPILE"  # "0": run the engine's functions eagerly
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


class _Compiled:
    """A torch.compile'd function that turns into the eager one after a compiler failure."""

    def __init__(self, fn: Callable[..., Any], dynamic: bool | None = None) -> None:
        self.eager = fn
        _raise_recompile_limit()
        self.compiled: Callable[..., Any] | None = torch.compile(
            fn, fullgraph=True, dynamic=dynamic
        )

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as error:  # noqa: BLE001 - any compiler failure: run eager
                _log.warning(
                    "torch.compile of %s failed (%s: %s); running it eagerly",
                    getattr(self.eager, "__qualname__", self.eager), type(error).__name__,
                    str(error).splitlines()[0] if str(error) else "",
                )  # fmt: skip
                self.compiled = None
        return self.eager(*args)


def maybe_compiled(
    fn: Callable[..., Any], enabled: bool, dynamic: bool | None = None
) -> Callable[..., Any]:
    """fn compiled when enabled (falling back to fn on a compiler failure), else fn. dynamic:
    torch.compile's (True: one code for every size of the inputs' dimensions, except sizes
    0 and 1, which dynamo specialises)."""
    return _Compiled(fn, dynamic) if enabled else fn


def compiles_by_default(device: torch.device) -> bool:
    """Whether the engine's forward compiles its functions on `device` unless told: on CUDA
    (there they are bound by small kernels; elsewhere compile time outweighs the gain),
    unless ROLLSERVE_ENGINE_COMPILE=0."""
    compiles = device.type == "cuda" and os.environ.get(COMPILE_ENV, "1") != "0"
    if compiles and c_compiler() is None:
        _warn_without_c_compiler()
    return compiles


def c_compiler() -> str | None:
    """The C compiler Triton (torch.compile's CUDA backend) builds its kernel launchers with,
    found as Triton finds it: $CC, else gcc, else clang on PATH; None without one."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return shutil.which("gcc") or shutil.which("clang")


@functools.cache
def _warn_without_c_compiler() -> None:
    """Say once, at the engine's start, what a missing compiler will cost: every compiled
    function fails its first call and runs eager for good (several times slower on a GPU)."""
    _log.warning(
        "no C compiler ($CC, gcc or clang) on PATH: Triton cannot build the kernels of "
        "torch.compile, so the engine's compiled functions will run eagerly, several times "
        "slower; install gcc and the libc headers (the Dockerfile does), or set %s=0 to skip "
        "compiling",
        COMPILE_ENV,
    )
