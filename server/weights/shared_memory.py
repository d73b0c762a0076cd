"""The shared-memory data plane: copy an update file from a client's sealed memfd (same host).

The client (client/shared_memory.py) names its memfd by (pid, fd); the server opens
/proc/<pid>/fd/<fd> read-only, refuses it unless it is sealed against shrinking (a truncation
under a shared mapping would SIGBUS the server), and maps it. The head goes through the lane
that starts at 0 like any chunk; the data section is split into `lanes` byte ranges copied by
that many threads at once (numpy releases the GIL for the copy and the value checks), each
straight from the mapping into the staging arena, in pieces that stay in the CPU cache for the
value checks. The mapping of the last file is kept for the next update from the same file
(_RecentMapping): a sealed memfd cannot shrink, so its pages stay valid.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from rollserve.client.errors import FailedPrecondition, InvalidArgument
from rollserve.client.shared_memory import REQUIRED_SEALS
from rollserve.server.weights.staging import UpdateStager
from rollserve.server.weights.stream import Lane
from rollserve.v1 import rollout_pb2 as pb

__all__ = ["PIECE_BYTES", "default_lanes", "receive_shared_memory", "release_mappings"]

# Copied and checked per piece: small enough to stay in L3 between the copy and the check,
# large enough that the per-piece Python is small (0.48 GB update, 2-core VM: 1 MiB pieces
# 65 ms, 2 MiB 58, 4 MiB 57, 256 KiB 105).
PIECE_BYTES = 2 << 20
MAX_LANES = 4  # copying threads; memory-bound copies gain little past two per socket


def default_lanes(cpu_count: int | None) -> int:
    """One lane more than cores, at most MAX_LANES: while one lane checks a piece that is in the
    cache, another's memory-bound copy takes its core (2-core VM: 3 lanes 45-53 ms for 0.48 GB,
    2 lanes 50-58)."""
    return max(1, min(MAX_LANES, (cpu_count or 1) + 1))


def receive_shared_memory(
    stager: UpdateStager,
    source: pb.SharedMemorySource,
    *,
    lanes: int,
) -> None:
    """Copy the whole file of `source` into `stager` with `lanes` threads; verify as it lands."""
    total_bytes = stager.options.total_bytes
    with _MAPPINGS.mapping(source, total_bytes) as mapping:
        file = np.frombuffer(mapping, dtype=np.uint8, count=total_bytes)
        try:
            _copy(stager, file, lanes)
        finally:
            del file  # the mapping cannot close while a view of it lives


class _RecentMapping:
    """The last client file's mapping, kept for its next update while it is in use.

    Mapping a file is free, but the first read of each of its 4 KiB pages through a new mapping
    faults (measured: ~30 ms of a 0.1 s update of 0.48 GB); a trainer sends every update from
    the same memfd, so the server keeps the mapping of the last one and reuses it while the
    file (device and inode, checked on every update) is the same. It is dropped when another
    file comes, after `_KEEP_S` without an update (so the memory of a trainer that exited is
    freed soon after), and at shutdown.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[int, int] | None = None
        self._mapping: mmap.mmap | None = None
        self._size = 0
        self._timer: threading.Timer | None = None

    @contextlib.contextmanager
    def mapping(self, source: pb.SharedMemorySource, total_bytes: int) -> Iterator[mmap.mmap]:
        with self._lock:
            fd, info = _open(source, total_bytes)
            try:
                key = (info.st_dev, info.st_ino)
                if key != self._key or self._size < total_bytes:
                    self._drop()
                    self._mapping = mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ)
                    self._key, self._size = key, info.st_size
            finally:
                os.close(fd)
            if self._timer is not None:
                self._timer.cancel()
            assert self._mapping is not None
            try:
                yield self._mapping
            finally:
                self._timer = threading.Timer(_KEEP_S, self.release)
                self._timer.daemon = True
                self._timer.start()

    def release(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                pass  # an exception's traceback still holds a view: it goes with the last one
        self._key, self._mapping, self._size = None, None, 0


_KEEP_S = 30.0
_MAPPINGS = _RecentMapping()


def release_mappings() -> None:
    """Unmap the kept client file (the server is shutting down)."""
    _MAPPINGS.release()


def _copy(stager: UpdateStager, file: np.ndarray, lanes: int) -> None:
    total_bytes = len(file)
    # Where the data begins, from the length prefix (the lane at 0 validates it while parsing).
    prefix = int.from_bytes(file[:8].tobytes(), "little") if total_bytes >= 8 else 0
    data_start = min(8 + prefix, total_bytes)
    bounds = _split(data_start, total_bytes, min(lanes, MAX_LANES))
    parts = [
        stager.lane(begin, end)
        for begin, end in zip([0, *bounds], [*bounds, total_bytes], strict=True)
    ]
    try:
        _feed_range(parts[0].feed, file, 0, data_start)  # the head: the arena exists after it
        futures = [_lane_pool().submit(_feed_lane, part, file) for part in parts]
        for future in futures:
            future.result()
    except BaseException as error:
        stager.fail(error)
        raise


@functools.cache
def _lane_pool() -> ThreadPoolExecutor:
    # One pool for the process (one update runs at a time): no thread start-up per update.
    return ThreadPoolExecutor(MAX_LANES, thread_name_prefix="shm-lane")


def _feed_lane(lane: Lane, file: np.ndarray) -> None:
    if lane.begin > 0:
        lane.start_in_data(timeout_s=0)  # the head was parsed before this thread started
    _feed_range(lane.feed, file, lane.position, lane.end)


def _feed_range(feed: Callable[..., None], file: np.ndarray, begin: int, end: int) -> None:
    for offset in range(begin, end, PIECE_BYTES):
        feed(offset, file[offset : min(offset + PIECE_BYTES, end)])


def _split(data_start: int, total_bytes: int, lanes: int) -> list[int]:
    """Interior boundaries that cut the data section into `lanes` near-equal, 64-byte-aligned
    ranges (elements cut at a boundary are checked once at the end, stream.py)."""
    size = total_bytes - data_start
    bounds = []
    for i in range(1, lanes):
        cut = data_start + (size * i // lanes) // 64 * 64
        if data_start < cut < total_bytes and (not bounds or cut > bounds[-1]):
            bounds.append(cut)
    return bounds


def _open(source: pb.SharedMemorySource, total_bytes: int) -> tuple[int, os.stat_result]:
    """Open the client's memfd read-only after checking what it is; the fd and its stat."""
    if source.pid <= 0 or source.fd < 0:
        raise InvalidArgument(
            f"shared_memory: pid {source.pid} and fd {source.fd} do not name a file"
        )
    path = f"/proc/{source.pid}/fd/{source.fd}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise FailedPrecondition(_open_error(path, error)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"shared_memory: {path} is not a memfd or regular file")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # a file that cannot be sealed (not a memfd)
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise InvalidArgument(
                "shared_memory: the file must be a memfd sealed with F_SEAL_SHRINK and "
                "F_SEAL_GROW (a truncation while the server reads would crash it)"
            )
        if info.st_size < total_bytes:
            raise InvalidArgument(
                f"shared_memory: the file holds {info.st_size} bytes, fewer than "
                f"header.total_bytes {total_bytes}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def _open_error(path: str, error: OSError) -> str:
    if error.errno == errno.ENOENT:
        return (
            f"shared_memory: {path} does not exist on the server's host (is the client on the "
            "same host and in the same PID namespace, and still running?)"
        )
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"shared_memory: the server may not open {path} (run both as the same user)"
    return f"shared_memory: cannot open {path}: {os.strerror(error.errno or 0)}"
