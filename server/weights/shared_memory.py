"""The shared-memory data plane: copy an update file from a client's sealed memfd (same host).

The client (client/shared_memory.py) names its memfd by (pid, fd); the server stats
/proc/<pid>/fd/<fd> and refuses anything but a regular file unopened (a FIFO's open would block),
opens it read-only and non-blocking, refuses it unless it is sealed against shrinking (a
truncation under a shared mapping would SIGBUS the server; only a memfd takes these seals), and
maps it. The head goes through the lane that starts at 0 like any chunk; the data section is
cut into stripes that `lanes` threads take in file order (numpy releases the GIL for the copy
and the value checks), each copied straight from the mapping into the staging arena, in pieces
that stay in the CPU cache for the value checks. Into a device arena (a CUDA model) each piece
fills a slot of the pinned ring and is copied to the device asynchronously while the lane
copies the next one (pipeline.py); the checks run on the device. A *streamed* file is still
being written by the client when the call starts: the handler thread follows its
SharedMemoryWritten counts (_Written) and each piece is copied once the count covers it, so the
client's copy and the server's overlap. The mapping of the last file is kept for the next update
from the same file (_RecentMapping): a sealed memfd cannot shrink, so its pages stay valid.
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
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from queue import Empty, SimpleQueue

import numpy as np
import torch

from ...client.protocol.errors import FailedPrecondition, InvalidArgument
from ...client.protocol.page_lock import host_tensor, register_host_range, unregister_host_range
from ...client.protocol.shared_memory import REQUIRED_SEALS
from ...v1 import rollout_pb2 as pb
from .staging import Request, UpdateStager, iter_chunks, iter_shm_written
from .stream import Lane
from .timings import UpdateTimings

__all__ = [
    "PIECE_BYTES",
    "default_lanes",
    "mapping_page_locked",
    "receive_shared_memory",
    "release_mappings",
]

# Copied and checked per piece: small enough to stay in L3 between the copy and the check,
# large enough that the per-piece Python is small (the sizes tried: bench/RESULTS.md).
PIECE_BYTES = 2 << 20
# Into a device arena no host check follows the copy: a piece fills one slot of the pinned ring
# (pipeline.py: SLOT_BYTES unless the arena's ring says otherwise), so each host-to-device copy
# is as large as the ring allows.
# From a page-locked mapping a piece is one DMA copy: large, so launches cost little, and small
# enough that a streamed file's copies follow close behind the client's writes.
DMA_PIECE_BYTES = 32 << 20
MAX_LANES = 4  # copying threads; memory-bound copies gain little past two per socket
# The data section is cut into stripes that the lanes take in file order: with a streamed file,
# the lanes copy right behind the client's writes.
STRIPE_BYTES = 32 << 20
MAX_STRIPES = 256


def default_lanes(cpu_count: int | None) -> int:
    """One lane more than cores, at most MAX_LANES: while one lane checks a piece that is in the
    cache, another's memory-bound copy takes its core (bench/RESULTS.md)."""
    return max(1, min(MAX_LANES, (cpu_count or 1) + 1))


def receive_shared_memory(
    stager: UpdateStager,
    source: pb.SharedMemorySource,
    requests: Iterator[Request],
    *,
    lanes: int,
) -> None:
    """Copy the whole file of `source` into `stager` with `lanes` threads; verify as it lands.

    A streamed source is still being written by the client: this thread follows its
    SharedMemoryWritten messages while the lanes copy each part once it is written."""
    total_bytes = stager.options.total_bytes
    written = _Written(total_bytes, iter_shm_written(requests) if source.streamed else None)
    with _MAPPINGS.mapping(source, total_bytes) as mapping:
        stager.timings.lap("open")
        file = np.frombuffer(mapping, dtype=np.uint8, count=total_bytes)
        try:
            _copy(stager, file, lanes, written)
        finally:
            del file  # the mapping cannot close while a view of it lives
    if not source.streamed:
        for _ in iter_chunks(requests):
            raise InvalidArgument("an update from shared memory carries no chunks")


class _Written:
    """How much of the file the client has written: everything (`counts` None), or what the
    stream's SharedMemoryWritten `counts` said so far. Lanes wait here before copying a piece."""

    def __init__(self, total_bytes: int, counts: Iterator[int] | None) -> None:
        self.bytes = total_bytes if counts is None else 0
        self._total_bytes = total_bytes
        self._counts = counts
        self._changed = threading.Condition()
        self._failure: BaseException | None = None

    def wait_for(self, end: int) -> None:
        if self.bytes >= end:  # always, unless streamed: no lock on the common path
            return
        with self._changed:
            while self.bytes < end:
                if self._failure is not None:
                    raise InvalidArgument(f"the update failed elsewhere: {self._failure}")
                self._changed.wait()

    def advance(self, written_bytes: int) -> None:
        if not self.bytes <= written_bytes <= self._total_bytes:
            raise InvalidArgument(
                f"shm_written: {written_bytes} bytes after {self.bytes}; it must not decrease "
                f"nor pass header.total_bytes {self._total_bytes}"
            )
        with self._changed:
            self.bytes = written_bytes
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._changed:
            if self._failure is None:
                self._failure = error
            self._changed.notify_all()

    def follow(self, until: int | None = None) -> None:
        """Advance with the stream's counts until `until` bytes are written, or else to the
        stream's end, where the last must have said all."""
        if self._counts is None or (until is not None and self.bytes >= until):
            return
        for written_bytes in self._counts:
            self.advance(written_bytes)
            if until is not None and self.bytes >= until:
                return
        if self.bytes != self._total_bytes:
            raise InvalidArgument(
                f"the stream ended when {self.bytes} of the file's {self._total_bytes} bytes "
                "were written (the last shm_written must say header.total_bytes)"
            )


class _RecentMapping:
    """The last client file's mapping, kept for its next update while it is in use.

    Mapping a file is free, but the first read of each of its 4 KiB pages through a new mapping
    faults, a large share of a warm update's time; a trainer sends every update from
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
        # The mapping page-locked for a CUDA device (client/protocol/page_lock.py): the array
        # over it and the device; None when not registered.
        self._locked: tuple[np.ndarray, torch.device] | None = None
        self._lock_refused = False  # registering this mapping failed: not tried again

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

    @property
    def locked(self) -> bool:
        return self._locked is not None

    def page_locked(self, device: torch.device, nbytes: int) -> np.ndarray | None:
        """The mapping's first `nbytes` as an array whose memory is page-locked for `device`
        (CUDA), so copies from it go by DMA; registered on first use and kept with the mapping
        (registered again for a larger update). None when it cannot be (not CUDA, refused).
        Call inside `mapping` (whose lock is held).

        Only the update's own bytes are pinned, never the whole file: a client may size its
        memfd as it likes (a sparse terabyte), while the update's size was checked against the
        model with its head before this is called."""
        if self._locked is not None and self._locked[1] == device:
            if len(self._locked[0]) >= nbytes:
                return self._locked[0][:nbytes]
        if self._mapping is None or self._lock_refused or device.type != "cuda":
            return None
        self._unlock()
        array = np.frombuffer(self._mapping, dtype=np.uint8, count=nbytes)
        if not register_host_range(array, device, read_only=True):
            self._lock_refused = True
            return None
        self._locked = (array, device)
        return array

    def release(self) -> None:
        with self._lock:
            self._drop()

    def _unlock(self) -> None:
        if self._locked is not None:
            unregister_host_range(*self._locked)
            self._locked = None

    def _drop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._unlock()  # before the unmap: no copy from it is in flight between updates
        self._lock_refused = False
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                pass  # an exception's traceback still holds a view: it goes with the last one
        self._key, self._mapping, self._size = None, None, 0


_KEEP_S = 30.0
_MAPPINGS = _RecentMapping()


def mapping_page_locked() -> bool:
    """Whether the kept client mapping is page-locked for a CUDA device (copied by DMA)."""
    return _MAPPINGS.locked


def release_mappings() -> None:
    """Unmap the kept client file (the server is shutting down)."""
    _MAPPINGS.release()


def _copy(stager: UpdateStager, file: np.ndarray, threads: int, written: _Written) -> None:
    total_bytes = len(file)
    try:
        # Where the data begins, from the length prefix (the lane at 0 validates it).
        written.follow(until=min(8, total_bytes))
        prefix = int.from_bytes(file[:8].tobytes(), "little") if total_bytes >= 8 else 0
        data_start = min(8 + prefix, total_bytes)
        written.follow(until=data_start)
        bounds = _stripes(data_start, total_bytes)
        stripes = [
            stager.lane(begin, end)
            for begin, end in zip([0, *bounds], [*bounds, total_bytes], strict=True)
        ]
        # The head (then the arena exists).
        _feed_range(stripes[0].feed, file, 0, data_start, written, timings=stager.timings)
        stager.timings.lap("head")
        page_locked = _page_locked_source(stager, stripes[0])
        queue: SimpleQueue[Lane] = SimpleQueue()
        for stripe in stripes:
            queue.put(stripe)
        futures = [
            _lane_pool().submit(_copy_stripes, queue, file, written, stager, page_locked)
            for _ in range(min(threads, MAX_LANES, len(stripes)))
        ]
        try:
            written.follow()  # this thread follows the writer while the lanes copy
        except BaseException as error:
            _stop(written, stager, error)  # wake the lanes waiting for bytes that will not come
            raise
        finally:
            errors = [future.exception() for future in futures]
        for error in errors:
            if error is not None:
                raise error
    except BaseException as error:
        _stop(written, stager, error)
        raise


def _stop(written: _Written, stager: UpdateStager, error: BaseException) -> None:
    """The update failed: every lane stops (waiting for the writer, or at its next piece)."""
    written.fail(error)
    stager.fail(error)


@functools.cache
def _lane_pool() -> ThreadPoolExecutor:
    # One pool for the process (one update runs at a time): no thread start-up per update.
    return ThreadPoolExecutor(MAX_LANES, thread_name_prefix="shm-lane")


def _page_locked_source(stager: UpdateStager, lane: Lane) -> torch.Tensor | None:
    """The whole mapping as a host tensor the device arena copies from by DMA (page_lock.py in
    client/protocol), or None: a host arena, a CPU "device" arena, a mapping that cannot be
    page-locked."""
    if not stager.head_parsed or lane.file_data.pipeline is None:
        return None
    device = lane.file_data.pipeline.device
    if device.type != "cuda":
        return None
    started_s = time.perf_counter()
    array = _MAPPINGS.page_locked(device, stager.options.total_bytes)
    stager.timings.add("page_lock", time.perf_counter() - started_s)
    return None if array is None else host_tensor(array)


def _copy_stripes(
    stripes: SimpleQueue[Lane],
    file: np.ndarray,
    written: _Written,
    stager: UpdateStager,
    page_locked: torch.Tensor | None,
) -> None:
    """Take the next stripe, in file order, until none is left (a streamed file is written in
    order, so the lanes follow the writer). From a page-locked mapping each piece is one DMA
    copy into the device arena (no host copy)."""
    try:
        while True:
            try:
                lane = stripes.get_nowait()
            except Empty:
                return
            if lane.begin > 0:
                lane.start_in_data(timeout_s=0)  # the head was parsed before this thread started
            pipeline = lane.file_data.pipeline if stager.head_parsed else None
            feed: Callable[..., None] = lane.feed
            piece_bytes = PIECE_BYTES if pipeline is None else pipeline.slot_bytes
            if page_locked is not None:
                feed, piece_bytes = _dma_feed(lane, page_locked), DMA_PIECE_BYTES
            _feed_range(feed, file, lane.position, lane.end, written, piece_bytes, stager.timings)
    except BaseException as error:
        _stop(written, stager, error)
        raise


def _dma_feed(lane: Lane, source: torch.Tensor) -> Callable[[int, np.ndarray], None]:
    """A lane's feed that hands over the page-locked bytes of each piece instead of the piece."""

    def feed(offset: int, piece: np.ndarray) -> None:
        lane.feed_tensor(offset, source[offset : offset + len(piece)], held_host=True)

    return feed


def _feed_range(
    feed: Callable[..., None],
    file: np.ndarray,
    begin: int,
    end: int,
    written: _Written,
    piece_bytes: int = PIECE_BYTES,
    timings: UpdateTimings | None = None,
) -> None:
    # timings: where the lane's waits for the client's writes add up (writer_wait).
    waiting_s = 0.0
    waits = 0
    for offset in range(begin, end, piece_bytes):
        piece_end = min(offset + piece_bytes, end)
        if written.bytes < piece_end:  # a streamed file not yet written this far
            asked_s = time.perf_counter()
            written.wait_for(piece_end)
            waiting_s += time.perf_counter() - asked_s
            waits += 1
        feed(offset, file[offset:piece_end])
    if waits and timings is not None:
        timings.add("writer_wait", waiting_s, waits)


def _stripes(data_start: int, total_bytes: int) -> list[int]:
    """Interior boundaries that cut the data section into 64-byte-aligned stripes of about
    STRIPE_BYTES (at most MAX_STRIPES), which the lanes take in turn (elements cut at a
    boundary are checked once at the end, stream.py)."""
    size = total_bytes - data_start
    stripe = max(STRIPE_BYTES, -(-size // MAX_STRIPES)) // 64 * 64
    return list(range(data_start + stripe, total_bytes, stripe))


def _open(source: pb.SharedMemorySource, total_bytes: int) -> tuple[int, os.stat_result]:
    """Open the client's memfd read-only after checking what it is; the fd and its stat.

    Never blocks: the path is stat'ed first and anything but a regular file (a FIFO, whose
    blocking open waits for a writer while holding the update lock; a socket; a device, whose
    open may act) is refused unopened. The open itself is O_NONBLOCK as well, in case the
    client swaps the descriptor between the stat and the open; fstat then checks the opened
    file again, and its seals prove it is a memfd.
    """
    if source.pid <= 0 or source.fd < 0:
        raise InvalidArgument(
            f"shared_memory: pid {source.pid} and fd {source.fd} do not name a file"
        )
    path = f"/proc/{source.pid}/fd/{source.fd}"
    try:
        _check_regular(path, os.stat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as error:
        raise FailedPrecondition(_open_error(path, error)) from None
    try:
        info = os.fstat(fd)
        _check_regular(path, info.st_mode)
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


def _check_regular(path: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise InvalidArgument(f"shared_memory: {path} is a {kind}, not a memfd; it is not opened")


_KINDS = {
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFDIR: "directory",
}


def _open_error(path: str, error: OSError) -> str:
    if error.errno == errno.ENOENT:
        return (
            f"shared_memory: {path} does not exist on the server's host (is the client on the "
            "same host and in the same PID namespace, and still running?)"
        )
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"shared_memory: the server may not open {path} (run both as the same user)"
    return f"shared_memory: cannot open {path}: {os.strerror(error.errno or 0)}"
