"""Page-locking a client's shared-memory mapping, so a CUDA server copies from it by DMA.

Into a CUDA model the shared-memory plane used to copy every byte twice on the host side: the
lanes' memcpy from the mapping into a slot of the pinned ring, then the ring's host-to-device
copy (pipeline.py). The memcpy is the slow half (~10 GB/s from four lanes against ~55 GB/s of a
pinned copy on an H100, bench/RESULTS.md). Registered with cudaHostRegister, the mapping itself
is page-locked: its bytes go straight to the device arena with `non_blocking=True` copies and
no host copy at all.

The mapping is read-only (the server never writes a client's memory), so it is registered with
cudaHostRegisterReadOnly; a device or driver that refuses it (or anything else that fails)
leaves the mapping unregistered and the update takes the ring, as before. Registering pins every
page of the file once (a cost of the first update from a file); the mapping is kept for the
next update from the same file (shared_memory.py, _RecentMapping), and so is its registration.
It must be unregistered before the mapping is closed, with no copy from it in flight (every
update waits for its copies before it returns).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

__all__ = ["host_tensor", "register_host_range", "unregister_host_range"]

_log = logging.getLogger("rollserve.weights")

# cudaHostRegister flags (cuda_runtime_api.h): usable from every CUDA context, and read-only
# (the mapping is PROT_READ: pinning it for writing would fail).
_PORTABLE = 0x01
_READ_ONLY = 0x08


def register_host_range(array: np.ndarray, device: torch.device) -> bool:
    """Page-lock the memory of a 1-D uint8 array for `device`'s copies; whether it worked."""
    if device.type != "cuda" or not torch.cuda.is_available() or array.nbytes == 0:
        return False
    cudart = torch.cuda.cudart()
    pointer = array.ctypes.data
    with torch.cuda.device(device):
        status = cudart.cudaHostRegister(pointer, array.nbytes, _PORTABLE | _READ_ONLY)
        if status != cudart.cudaError.success:
            _clear_last_error(device)
            _log.info(
                "the shared-memory mapping could not be page-locked (%s): its bytes go through "
                "the pinned ring",
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
