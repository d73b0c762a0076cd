"""Same-host weight updates: the safetensors file in a sealed memfd that the server copies from.

A trainer on the server's host (colocated, the common case) writes the file into shared memory
with one copy from its tensors (multi-threaded torch copies), and the UpdateWeights call carries
only the header and a reference, (pid, fd). The server opens /proc/<pid>/fd/<fd>, checks the
seals and the size, and copies the bytes into its staging arena; the verification, version and
atomic swap are those of every other transport.

Why a memfd sealed against shrinking and growing: a reader of a shared mapping that another
process truncates gets SIGBUS, which would kill the server. F_SEAL_SHRINK makes the size final
while the pages stay writable, so one memfd serves update after update with warm pages (a fresh
mapping is faulted in page by page at about 1 GB/s on our VMs; reference/transport.md).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["SharedMemoryFile", "shm_host_id"]

# Files are sized up to this granularity, so that updates of slightly different sizes (partial
# updates, LoRA) reuse one memfd.
_SIZE_STEP_BYTES = 2 * 1024 * 1024
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def shm_host_id() -> str:
    """Who can open this process's memfds by /proc/<pid>/fd: same boot, same PID namespace."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    pid_namespace = os.stat("/proc/self/ns/pid").st_ino
    return f"{boot_id}/{pid_namespace}"


class SharedMemoryFile:
    """A reusable sealed memfd holding one safetensors file at a time (this process's side)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._mapping: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None  # uint8 view of the whole mapping

    @property
    def fd(self) -> int:
        assert self._fd is not None, "write a file first"
        return self._fd

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._bytes is None else self._bytes.numel()

    def write(
        self,
        head: bytes,
        tensors: list[tuple[int, torch.Tensor]],
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Write `head` at 0 and each (data offset, tensor) after it; size the memfd to fit.

        A tensor is copied once, straight from its memory (CPU or GPU) into the mapping, in its
        dtype and C order; `progress(bytes_written)` after each.
        """
        total = len(head) + sum(t.numel() * t.element_size() for _, t in tensors)
        self._reserve(total)
        assert self._bytes is not None
        destination = self._bytes
        destination[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        written = len(head)
        with torch.no_grad():
            for offset, tensor in tensors:
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes:
                    begin = len(head) + offset
                    view = destination[begin : begin + nbytes].view(tensor.dtype)
                    view.view(tensor.shape).copy_(tensor.detach())
                written += nbytes
                if progress is not None:
                    progress(written)

    def _reserve(self, nbytes: int) -> None:
        if nbytes <= self.capacity_bytes:
            return
        self.close()
        size = -(-nbytes // _SIZE_STEP_BYTES) * _SIZE_STEP_BYTES
        fd = os.memfd_create("rollserve-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._mapping = fd, mapping
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)

    def close(self) -> None:
        """Unmap and close the memfd (its memory is freed once the server closed it too)."""
        self._bytes = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
