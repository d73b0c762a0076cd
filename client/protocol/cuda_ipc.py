"""What trainer and server agree on for a CUDA IPC update (transport "cuda_ipc"): the bounds of
a CudaIpcSource, how a GPU is named across processes, and who may open whose handles.

A CUDA IPC handle opens only on the host whose driver made it, and torch's ref counter of a
shared storage is a file in that host's /dev/shm: the trainer sends `shm_host_id()` (the same
boot and PID namespace that Health.shm_host_id names), and a server that computes another value
refuses before touching anything. Device indices differ between processes
(CUDA_VISIBLE_DEVICES), so a buffer names its GPU by UUID (`device_uuid`) and the server opens it
on its own index of that GPU.
"""

from __future__ import annotations

import functools
import hashlib
import re

import torch

from .shared_memory import shm_host_id

__all__ = [
    "EVENT_HANDLE_BYTES",
    "MAX_BUFFERS",
    "MAX_HANDLE_BYTES",
    "MAX_SPANS",
    "REF_COUNTER_NAME",
    "REF_COUNTER_SLOTS",
    "cuda_ipc_host_id",
    "device_uuid",
]

# A plain state dict has one buffer per storage; the largest models have a few thousand.
MAX_BUFFERS = 16384
# One span per tensor at most (fewer where neighbours lie back to back in one storage).
MAX_SPANS = 65536
# cudaIpcMemHandle_t is 64 bytes; torch's allocator may prefix or extend it (expandable
# segments), so only a generous bound is checked.
MAX_HANDLE_BYTES = 65536
EVENT_HANDLE_BYTES = 64  # cudaIpcEventHandle_t
# torch's producer-side ref counters: slots of int64 in a shared-memory file of this many
# (CUDA_IPC_REF_COUNTER_FILE_SIZE in torch/csrc/CudaIPCTypes.h), named by one path component
# of /dev/shm. The server decrements slot `ref_counter_offset` of that file: both are checked.
REF_COUNTER_SLOTS = 10000
REF_COUNTER_NAME = re.compile(rb"/[A-Za-z0-9._-]{1,254}")


def cuda_ipc_host_id() -> str:
    """Who can open this process's CUDA IPC handles and ref-counter files: Health.shm_host_id's
    value (same boot, same PID namespace); "" where it cannot be known (matches no server)."""
    return shm_host_id()


def device_uuid(device: torch.device | int) -> str:
    """The GPU's UUID as 32 lowercase hex digits: the same GPU gives the same value in every
    process of the host, whatever index CUDA_VISIBLE_DEVICES gives it there. Calls torch.cuda:
    only for CUDA devices."""
    index = device if isinstance(device, int) else device.index
    if index is None:
        index = torch.cuda.current_device()
    return _uuid_of(index)


@functools.cache
def _uuid_of(index: int) -> str:
    """device_uuid of this process's device `index`: fixed for the process (both sides ask
    for it at every update, a server once per device it sees)."""
    uuid = torch.cuda.get_device_properties(index).uuid
    raw = getattr(uuid, "bytes", None)  # torch's _CUuuid: 16 bytes
    if isinstance(raw, bytes | bytearray | list | tuple) and len(raw) == 16:
        return bytes(raw).hex()
    # Only its text ("GPU-xxxxxxxx-xxxx-..." or the bare UUID): its hex digits, or a digest of
    # it where that is not a UUID (both sides run this same function).
    text = str(uuid).lower().removeprefix("gpu-")
    digits = "".join(c for c in text if c in "0123456789abcdef")
    return digits if len(digits) == 32 else hashlib.md5(text.encode()).hexdigest()
