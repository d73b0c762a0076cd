"""Page-locking shared memory, so a CUDA device copies to or from it by DMA.

Both sides of the shared-memory data plane (client/weights/shared_memory.py,
server/weights/shared_memory.py) copy between a memfd mapping and a CUDA device. From pageable
memory such a copy is staged by the driver, or, on the server, went through a memcpy into a slot
of its pinned ring first (pipeline.py): the memcpy held shm into a CUDA server at ~0.19 of a
pinned host-to-device copy on an H100 (bench/RESULTS.md). Registered with cudaHostRegister, the
mapping itself is page-locked and torch copies from or to it asynchronously, by DMA.

The server maps a client's file read-only (it never writes a client's memory), so it registers
with cudaHostRegisterReadOnly; the client's own mapping is writable. A device or driver that
refuses (or anything else that fails) leaves the memory unregistered and the copies take their
old path. Registering pins every page once (a cost of the first update from a file); both sides
keep their mapping for the next update, and its registration with it. It must be unregistered
before the mapping is closed, with no copy from or to it in flight.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

__all__ = ["host_tensor", "register_host_range", "unregister_host_range"]

_log = logging.getLogger("rollserve.shared_memory")

# cudaHostRegister flags (cuda_runtime_api.h): usable from every CUDA context; read-only for a
# PROT_READ mapping (pinning it for writing would fail).
_PORTABLE = 0x01
_READ_ONLY = 0x08


def register_host_range(array: np.ndarray, device: torch.device, *, read_only: bool) -> bool:
    """Page-lock the memory of a 1-D uint8 array for `device`'s copies; whether it worked."""
    if device.type != "cuda" or not torch.cuda.is_available() or array.nbytes == 0:
        return False
    cudart = torch.cuda.cudart()
    pointer = array.ctypes.data
    flags = _PORTABLE | (_READ_ONLY if read_only else 0)
    with torch.cuda.device(device):
        status = cudart.cudaHostRegister(pointer, array.nbytes, flags)
        if status != cudart.cudaError.success:
            _clear_last_error(device)
            _log.info(
                "a shared-memory mapping could not be page-locked (%s): its copies stay staged",
                cudart.cudaGetErrorString(status),
            )
            return False
    # torch copies asynchronously only from memory it sees as pinned: check it does.
    if not host_tensor(array).is_pinned():
        unregister_host_range(array, device)
        return False
    return True


def unregister_host_range(array: np.ndarray, device: torch.device) -> None:
    """Undo register_host_range (before the mapping closes)."""
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):
        if cudart.cudaHostUnregister(array.ctypes.data) != cudart.cudaError.success:
            _clear_last_error(device)


def host_tensor(array: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over the (read-only) array's memory, for copies from it (never written)."""
    with warnings.catch_warnings():  # torch warns that the array is not writable: it is read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _clear_last_error(device: torch.device) -> None:
    """A failed runtime call leaves its error as the thread's last error, which torch's check
    after the next kernel launch would raise as that kernel's failure: read it now (a launch
    whose check raises it, and so resets it)."""
    try:
        torch.zeros(1, device=device).add_(1)
    except Exception:  # noqa: BLE001 - the leftover error, now consumed
        pass
