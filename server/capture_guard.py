"""CUDA graph captures kept apart from the device work of other threads of the process.

The engine captures its decode steps on the engine thread (generation/runner.py: a request's
first step of a shape; attention.py: the decode attention pick), while UpdateWeights stages new
weights on gRPC handler threads (weights/update.py) and closes a trainer's CUDA IPC handles
(weights/cuda_ipc.py). A capture records work, it does not run it: the capturing thread may
make no call that waits for the device, and a synchronising call from another thread on the
same GPU can invalidate the capture whatever its mode (cudaDeviceSynchronize, a synchronous
copy: llama.cpp#14033, TensorRT#2888, and ROCm's measurements of CUDA, rocm-systems#4508). The
capture then fails, and with it the request that made it, or the update whose call broke it.

So the two never overlap: each holds `apart_from_captures(device)`, one process-wide lock (a
no-op off CUDA). An update holds it while it receives and verifies its bytes (waits for the
network and its peers included: seconds), and while its plane closes what it opened, but never
while it waits for its swap: the swap runs on the engine thread, whose running job may be about
to capture. The engine never waits for it on a request's path: a step whose graph is not
captured yet captures only if the lock is free (`captures_now`), else it has run as an eager
step and captures at a later use; a capture holds it for tens of milliseconds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["apart_from_captures", "captures_now"]

# Reentrant: a plane's exit may run inside an update's hold on the same thread.
_LOCK = threading.RLock()


@contextmanager
def apart_from_captures(device: torch.device) -> Iterator[None]:
    """Hold the capture lock while inside, for device work on `device` (nothing off CUDA)."""
    with captures_now(device, wait=True):
        yield


@contextmanager
def captures_now(device: torch.device, *, wait: bool) -> Iterator[bool]:
    """For a capture on `device`: whether it may capture now (inside, the lock is held); with
    `wait` false it does not wait for an update's device work, and says False while one runs."""
    if device.type != "cuda":
        yield True
        return
    held = _LOCK.acquire(blocking=wait)
    try:
        yield held
    finally:
        if held:
            _LOCK.release()
