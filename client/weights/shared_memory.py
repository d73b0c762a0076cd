"""Same-host weight updates: the safetensors file in a sealed memfd that the server copies from.

A trainer on the server's host (colocated, the common case) writes the file into shared memory
with one copy from its tensors (numpy copies in a few threads, in file order), and the
UpdateWeights call carries only the header, a reference, (pid, fd), and how much of the file is
written so far (the server copies each part as soon as it is written: the two copies overlap).
The server opens /proc/<pid>/fd/<fd>, checks the seals and the size, and copies the bytes into
its staging arena; the verification, version and atomic swap are those of every other transport.

Why a memfd sealed against shrinking and growing: a reader of a shared mapping that another
process truncates gets SIGBUS, which would kill the server (protocol/shared_memory.py names the
seals). F_SEAL_SHRINK makes the size final while the pages stay writable, so one memfd serves
update after update with warm pages: a fresh mapping would be faulted in page by page, which is
slower than the copy itself (bench/RESULTS.md).
"""

from __future__ import annotations

import fcntl
import functools
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..protocol.page_lock import register_host_range, unregister_host_range
from ..protocol.shared_memory import REQUIRED_SEALS

__all__ = ["WRITE_THREADS_ENV", "SharedMemoryFile", "write_threads"]

# Files are sized up to this granularity, so that updates of slightly different sizes (partial
# updates, LoRA) reuse one memfd.
_SIZE_STEP_BYTES = 2 * 1024 * 1024
# Threads writing CPU tensors into the mapping, unless ROLLSERVE_SHM_WRITE_THREADS says (read
# at each write). On the H100 node the shm lane of CPU tensors spent 54 ms of 66 receiving 1.26
# GB (bench/RESULTS.md, 17:11 UTC 2026-11-26), more than twice the server's host-to-device copy
# of it (~23 ms at the pinned ceiling): most likely waiting for these four threads' copies (~23
# GB/s). Whether more threads copy faster there is bench_gpu_weights.py's to measure: the host
# copy at 1, 4 and 8 threads, and a lane of 8 writing threads.
WRITE_THREADS_ENV = "ROLLSERVE_SHM_WRITE_THREADS"
_DEFAULT_WRITE_THREADS = max(1, min(4, os.cpu_count() or 1))
# Tensors are written in slices of this size, in file order: the threads share a large tensor,
# and a streamed update's server copies each slice soon after it is written.
_WRITE_PIECE_BYTES = 8 << 20


def write_threads() -> int:
    """The writing threads: ROLLSERVE_SHM_WRITE_THREADS (1 to 64) when set, else 4 (fewer on a
    smaller host); ValueError for a value that is not such a number."""
    value = os.environ.get(WRITE_THREADS_ENV, "").strip()
    if not value:
        return _DEFAULT_WRITE_THREADS
    if not value.isdigit() or not 1 <= int(value) <= 64:
        raise ValueError(f"{WRITE_THREADS_ENV} must be a number from 1 to 64, got {value!r}")
    return int(value)


def _pieces(begin: int, tensor: torch.Tensor) -> list[tuple[int, np.ndarray | torch.Tensor]]:
    """(file offset, source) pieces that write `tensor`'s elements (C order) at `begin`: its
    bytes in _WRITE_PIECE_BYTES slices, numpy arrays for a CPU tensor, uint8 tensors on the
    device for a GPU one. A GPU tensor in slices too: the server copies each slice to its
    device as soon as it is written, so a large tensor's device-to-host and host-to-device
    copies overlap instead of running one after the other (an embedding is ~20 % of a model)."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return []
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    source = flat.numpy() if flat.device.type == "cpu" else flat
    return [
        (begin + offset, source[offset : offset + _WRITE_PIECE_BYTES])
        for offset in range(0, nbytes, _WRITE_PIECE_BYTES)
    ]


Piece = tuple[int, np.ndarray | torch.Tensor]  # (file offset, source)


def _write_piece(destination: np.ndarray, begin: int, source: np.ndarray | torch.Tensor) -> int:
    """Copy one piece to destination[begin:]; the bytes written."""
    nbytes = source.nbytes  # numpy and torch alike
    if isinstance(source, np.ndarray):
        np.copyto(destination[begin : begin + nbytes], source)
    else:  # 1-D uint8 on a device (_pieces): device to host, into the mapping
        torch.from_numpy(destination[begin : begin + nbytes]).copy_(source)
    return nbytes


def _write_batch(destination: np.ndarray, batch: list[Piece]) -> int:
    return sum(_write_piece(destination, begin, source) for begin, source in batch)


def _batches(pieces: list[Piece]) -> list[list[Piece]]:
    """Pieces in file order, grouped into runs of about _WRITE_PIECE_BYTES: one thread task per
    run, not per tensor (a model's ~150 norm weights and biases would each cost a task hand-off,
    more than their copy)."""
    batches: list[list[Piece]] = []
    batch_bytes = 0
    for piece in pieces:
        if not batches or batch_bytes + piece[1].nbytes > _WRITE_PIECE_BYTES:
            batches.append([])
            batch_bytes = 0
        batches[-1].append(piece)
        batch_bytes += piece[1].nbytes
    return batches


def _lives_at(tensor: torch.Tensor, destination: np.ndarray, begin: int) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.data_ptr() == destination.ctypes.data + begin
    )


class SharedMemoryFile:
    """A reusable sealed memfd holding one safetensors file at a time (this process's side)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._mapping: mmap.mmap | None = None
        self._size = 0
        self._shared = False  # some tensors are views of the mapping (share)
        self._pool: ThreadPoolExecutor | None = None  # the writing threads, kept between writes
        self._pool_threads = 0
        # The mapping page-locked for the CUDA device tensors come from (page_lock.py): their
        # device-to-host copies then go by DMA straight into it. Kept with the mapping.
        self._locked: tuple[np.ndarray, torch.device] | None = None
        self._lock_refused = False

    @property
    def fd(self) -> int:
        assert self._fd is not None, "write a file first"
        return self._fd

    @property
    def capacity_bytes(self) -> int:
        return self._size

    def write(
        self,
        head: bytes,
        tensors: list[tuple[int, torch.Tensor]],
        progress: Callable[[int], None] | None = None,
        written: Callable[[int], None] | None = None,
    ) -> None:
        """Write `head` at 0 and each (data offset, tensor) after it; size the memfd to fit.

        A CPU tensor is copied once, from its memory into the mapping, by numpy in `threads`
        threads (numpy releases the GIL; torch's copy would wake its OpenMP pool, whose spinning
        threads then compete with the server for the same cores); a GPU tensor is copied from
        the device straight into the mapping. `progress(bytes_written)` after each piece;
        `written(end)` whenever the file's bytes [0, end) are final, first right after the head
        (before any tensor is copied), last with the file's size: the streamed transport sends
        these to the server, which copies behind the writer.
        """
        total = len(head) + sum(t.numel() * t.element_size() for _, t in tensors)
        self._reserve(total)
        assert self._mapping is not None
        self._page_lock_for(tensors)
        destination = np.frombuffer(self._mapping, dtype=np.uint8, count=total)
        destination[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        begins = [len(head) + offset for offset, _ in tensors]
        pieces = [
            piece
            for begin, (_, tensor) in zip(begins, tensors, strict=True)
            if not _lives_at(tensor, destination, begin)
            for piece in _pieces(begin, tensor)
        ]
        pieces.sort(key=lambda piece: piece[0])
        batches = _batches(pieces)
        # The end of the final prefix of the file once each batch is written.
        prefix_ends = [batch[0][0] for batch in batches[1:]] + [total]
        done = total - sum(source.nbytes for _, source in pieces)
        if progress is not None:
            progress(done)  # the head and the tensors already in place (see share)
        if written is not None:
            written(pieces[0][0] if pieces else total)
        if batches:
            threads = write_threads()
            if self._pool is None or self._pool_threads != threads:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shm-write")
                self._pool_threads = threads
            write = functools.partial(_write_batch, destination)
            # map yields in order: after the i-th batch every byte before the next is final.
            results = self._pool.map(write, batches)
            for nbytes, prefix_end in zip(results, prefix_ends, strict=True):
                done += nbytes
                if progress is not None:
                    progress(done)
                if written is not None:
                    written(prefix_end)
            del write
        del destination  # no view may outlive a write: close() unmaps

    def share(self, head: bytes, tensors: list[tuple[int, torch.Tensor]]) -> None:
        """Write the file once, then make each CPU tensor a view of its own bytes in it.

        From then on the trainer's optimizer writes straight into shared memory, and `write`
        finds every tensor in place: an update costs no copy on this side at all, only the
        server's copy into its staging memory (the analogue of handing a server CUDA IPC handles
        of the trainer's tensors). The tensors must not change during an update (they do not
        while update_weights runs, unless another thread trains).
        """
        self.write(head, tensors)
        assert self._mapping is not None
        total = len(head) + sum(t.numel() * t.element_size() for _, t in tensors)
        shared = torch.frombuffer(self._mapping, dtype=torch.uint8, count=total)
        with torch.no_grad():
            for offset, tensor in tensors:
                nbytes = tensor.numel() * tensor.element_size()
                if tensor.device.type != "cpu" or not nbytes:
                    continue
                begin = len(head) + offset
                tensor.data = shared[begin : begin + nbytes].view(tensor.dtype).view(tensor.shape)
        self._shared = True

    @property
    def page_locked(self) -> bool:
        """Whether the mapping is page-locked for a CUDA device (tensors from it copy by DMA)."""
        return self._locked is not None

    def _page_lock_for(self, tensors: list[tuple[int, torch.Tensor]]) -> None:
        """Page-lock the mapping for the CUDA device of the first CUDA tensor, once."""
        device = next((t.device for _, t in tensors if t.device.type == "cuda"), None)
        if device is None or self._lock_refused or self._mapping is None:
            return
        if self._locked is not None and self._locked[1] == device:
            return
        self._unlock()
        array = np.frombuffer(self._mapping, dtype=np.uint8)
        if register_host_range(array, device, read_only=False):
            self._locked = (array, device)
        else:
            self._lock_refused = True

    def _unlock(self) -> None:
        if self._locked is not None:
            unregister_host_range(*self._locked)
            self._locked = None

    def _reserve(self, nbytes: int) -> None:
        if nbytes <= self.capacity_bytes:
            return
        self.close()
        self._shared = False
        size = -(-nbytes // _SIZE_STEP_BYTES) * _SIZE_STEP_BYTES
        fd = os.memfd_create("rollserve-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._mapping, self._size = fd, mapping, size

    def close(self) -> None:
        """Unmap and close the memfd (its memory is freed once the server closed it too).

        After `share`, the trainer's tensors keep the mapping alive (they are views of it).
        """
        self._size = 0
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        self._lock_refused = False
        if not self._shared:  # shared tensors live in the mapping: it stays, and so may its lock
            self._unlock()
        if self._mapping is not None and not self._shared:
            self._mapping.close()
        self._mapping = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
