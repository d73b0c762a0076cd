"""How an update's bytes leave the client: one gRPC stream, several, or shared memory.

Every transport sends the same WeightsHeader and gets the same UpdateWeightsResponse; the server
verifies, versions and swaps the same way (server/weights/). What differs is the data plane
(protocol/transports.py names them):

* "grpc": chunks on one UpdateWeights stream, or on `streams` parallel streams over separate
  TCP connections (each carries a byte range of the file);
* "shm": the file in a sealed memfd on the server's host (shared_memory.py); the call carries
  the header, then how much of the file is written so far: the server copies each part as soon
  as it is written;
* "cuda_ipc": CUDA tensors of a trainer on the server's host, handed over as CUDA IPC handles
  (cuda_ipc.py); the server copies them device to device. The call carries the header and the
  file's head only (one unary UpdateWeightsAtOnce where the server has it: server_calls.py),
  and the tensors are held until the reply. With pack=True they are first
  copied into one buffer of this client's on their GPU (packing.py): one handle, which a server
  on that GPU stages in place;
* "auto": "cuda_ipc" when every tensor is on CUDA and the server offers it on this host, else
  "shm" when the server says it shares this host (Health.shm_host_id), else "grpc". Auto is the
  only mode that falls back: when CUDA IPC or shared memory fails before any byte is staged (the
  server cannot open the handles or the memfd) it logs a warning and sends the update the next
  way down.

The fourth, "dist", is a torch.distributed broadcast to every server of a WeightsGroup
(distributed.py); it does not pass through here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from queue import SimpleQueue
from typing import Any

import grpc
import torch

from ...v1 import rollout_pb2 as pb
from ..protocol.errors import Cancelled, FailedPrecondition
from ..protocol.requests import Progress
from ..protocol.shared_memory import shm_host_id
from ..protocol.transports import AUTO, CUDA_IPC, SHM
from .cuda_ipc import CudaIpcExports, all_on_cuda, check_on_cuda, export_cuda_ipc
from .packing import PackBuffer
from .server_calls import CallOptions, ServerCalls
from .shared_memory import SharedMemoryFile
from .update_file import UpdateFile, prepare_update

__all__ = ["Uploads", "default_streams"]

_LOG = logging.getLogger(__name__)
# The debug line of a cuda_ipc update's client part: version, export and head s, buffers,
# spans, call s, the server's s (bench_gpu_weights.py reads it).
CUDA_IPC_CLIENT_LINE = (
    "cuda_ipc v%d: export and head %.4f s (%d buffers, %d spans), call %.4f s (server %.4f s)"
)
# The server's shm refusals that mean "this data plane cannot work here", not "bad update".
_SHM_UNREACHABLE = "shared_memory: "
# The same for CUDA IPC (server/weights/cuda_ipc.py: handles that do not open, a GPU it cannot
# see): nothing was staged, the update can go another way.
_CUDA_IPC_UNREACHABLE = "cuda_ipc: "
# A streamed shared-memory update tells the server about every this many more written bytes.
_WRITTEN_STEP_BYTES = 8 << 20

StartCall = Callable[..., Any]  # a raw-bytes UpdateWeights callable (wire.update_weights_callable)


def default_streams(cpu_count: int | None = None) -> int:
    """Parallel gRPC streams when none are asked for: one per 4 cores, 1 to 8.

    A stream costs a core or so on each end: on a small machine a second one only adds
    contention (bench/RESULTS.md), on a large one each stream gets its own cores.
    """
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(8, cores // 4))


class Uploads:
    """A client's upload side: its UpdateWeights callables, memfd and what it knows of the server.

    `calls` are the server's weights-side calls on the client's upload channel; `open_stream`
    opens one more sync UpdateWeights callable on a connection of its own (for parallel
    streams).
    """

    def __init__(
        self, calls: ServerCalls, open_stream: Callable[[], tuple[StartCall, grpc.Channel]]
    ) -> None:
        self._server = calls
        self._calls: list[StartCall] = [calls.update_weights]
        self._extra_channels: list[grpc.Channel] = []
        self._open_stream = open_stream
        self._health = calls.health
        self._shm = SharedMemoryFile()
        # Held from writing the memfd to the server's reply: the server reads it during the call,
        # so a second update from this client (another thread) must not overwrite it meanwhile.
        self._shm_lock = threading.Lock()
        # Per same-host transport (SHM, CUDA_IPC): whether the server offers it and shares this
        # host (Health, asked once), or False once it failed in a way that means it cannot work.
        self._server_takes: dict[str, bool] = {}
        self._cuda_ipc_exports = CudaIpcExports()  # each storage exported once (cuda_ipc.py)
        # pack=True (packing.py): held, like the memfd, from packing to the server's reply.
        self._pack = PackBuffer()
        self._pack_lock = threading.Lock()

    def send(
        self,
        update: UpdateFile,
        options: CallOptions,
        *,
        transport: str,
        streams: int | None,
        progress: Progress | None,
        pack: bool = False,
        cancel: threading.Event | None = None,
    ) -> pb.UpdateWeightsResponse:
        """Send one update over `transport` ("auto", "grpc", "shm" or "cuda_ipc", checked by
        UpdateOptions) and return the server's reply; `pack`: cuda_ipc from one buffer
        (packing.py). `cancel` set (from another thread) ends a gRPC or shared-memory upload
        with Cancelled before its next message: the server applies nothing, unless the whole
        file was already handed over."""
        if transport == CUDA_IPC or (transport == AUTO and self._auto_cuda_ipc(update, streams)):
            try:
                return self._send_cuda_ipc(update, options, progress, pack)
            except grpc.RpcError as error:
                if transport == CUDA_IPC or not _unreachable(error, _CUDA_IPC_UNREACHABLE):
                    raise
                self._server_takes[CUDA_IPC] = False
                _LOG.warning(
                    "CUDA IPC failed (%s); sending this update another way", error.details()
                )
            except _CannotExport as error:
                if transport == CUDA_IPC:
                    raise error.__cause__ from None  # type: ignore[misc]
                self._server_takes[CUDA_IPC] = False  # this process's allocator cannot share
                _LOG.warning(
                    "CUDA IPC export failed (%s); sending this update another way", error.__cause__
                )
        if transport == SHM or (transport == AUTO and self._auto_shm(update, streams)):
            try:
                return self._send_shm(update, options, progress, cancel)
            except grpc.RpcError as error:
                if transport == SHM or not _unreachable(error, _SHM_UNREACHABLE):
                    raise
                self._server_takes[SHM] = False
                _LOG.warning(
                    "shared memory failed (%s); sending this update over gRPC", error.details()
                )
        count = default_streams() if streams is None else streams
        return self._send_grpc(update, options, count, progress, cancel)

    def share(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Move the CPU tensors of `state_dict` into this client's memfd (see SharedMemoryFile)."""
        update = prepare_update(state_dict, version=0)
        head, specs = update.layout()
        with self._shm_lock:
            self._shm.share(head, [(spec.begin, state_dict[spec.name]) for spec in specs])

    def close(self) -> None:
        with self._shm_lock:
            self._shm.close()
        with self._pack_lock:
            self._pack.release()
        for channel in self._extra_channels:
            channel.close()
        self._extra_channels.clear()

    # ---- shared memory -----------------------------------------------------------------------

    def _auto_shm(self, update: UpdateFile, streams: int | None) -> bool:
        # Per-chunk CRC-32 and an explicit stream count are requests for the gRPC stream.
        if update.crc32 or streams is not None:
            return False
        return self._takes_same_host(SHM, timeout_s=10.0)

    def _takes_same_host(self, transport: str, timeout_s: float) -> bool:
        """Whether the server offers `transport` (SHM or CUDA_IPC) and shares this host (same
        boot and PID namespace: Health.shm_host_id); asked once, then remembered."""
        if transport not in self._server_takes:
            self._server_takes[transport] = self._offers_on_this_host(transport, timeout_s)
        return self._server_takes[transport]

    def _offers_on_this_host(self, transport: str, timeout_s: float) -> bool:
        try:
            health = self._health(timeout_s)
        except grpc.RpcError:
            return False  # the update itself will report why the server is unreachable
        local = shm_host_id()  # cuda_ipc_host_id() is the same identity
        return transport in health.weight_transports and bool(local) and health.shm_host_id == local

    def _send_shm(
        self,
        update: UpdateFile,
        options: CallOptions,
        progress: Progress | None,
        cancel: threading.Event | None = None,
    ) -> pb.UpdateWeightsResponse:
        if not self._takes_same_host(SHM, options.timeout_s):
            raise FailedPrecondition(
                "transport 'shm' needs the client on the server's host, in its PID namespace, "
                "and a server that accepts it (Health.shm_host_id differs or 'shm' is not in "
                "Health.weight_transports); use 'grpc' or 'auto'"
            )
        head, specs = update.layout()
        total_bytes = update.total_bytes
        tensors = [(spec.begin, update.state_dict[spec.name]) for spec in specs]
        report = None if progress is None else (lambda written: progress(written, total_bytes))
        with self._shm_lock:
            if progress is not None:
                progress(0, total_bytes)
            # Streamed: the call starts once the head is written and the server copies each
            # part as soon as this side has written it (the two copies overlap).
            stream = _WrittenStream(
                self._calls[0], options, lambda: self._shm_header(update), total_bytes, cancel
            )
            try:
                self._shm.write(head, tensors, report, written=stream.written_to)
            except BaseException:
                stream.abandon()
                raise
            return stream.result()

    def _shm_header(self, update: UpdateFile) -> bytes:
        header = pb.WeightsHeader()
        header.CopyFrom(update.header)
        header.shared_memory.pid = os.getpid()
        header.shared_memory.fd = self._shm.fd
        header.shared_memory.streamed = True
        return pb.UpdateWeightsRequest(header=header).SerializeToString()

    # ---- CUDA IPC ----------------------------------------------------------------------------

    def _auto_cuda_ipc(self, update: UpdateFile, streams: int | None) -> bool:
        # Tensors not all on CUDA (no torch.cuda call then), or a request for the gRPC stream.
        if not all_on_cuda(update.state_dict) or update.crc32 or streams is not None:
            return False
        return self._takes_same_host(CUDA_IPC, timeout_s=10.0)

    def _send_cuda_ipc(
        self, update: UpdateFile, options: CallOptions, progress: Progress | None, pack: bool
    ) -> pb.UpdateWeightsResponse:
        check_on_cuda(update.state_dict)  # before asking the server anything
        if not self._takes_same_host(CUDA_IPC, options.timeout_s):
            raise FailedPrecondition(
                "transport 'cuda_ipc' needs the client on the server's host, in its PID "
                "namespace, and a server on a CUDA device that accepts it (Health.shm_host_id "
                "differs or 'cuda_ipc' is not in Health.weight_transports); use 'auto'"
            )
        if not pack:
            return self._export_and_call(update, options, progress)
        with self._pack_lock:  # the server reads the buffer until it replies
            return self._export_and_call(self._pack.packed(update), options, progress)

    def _export_and_call(
        self, update: UpdateFile, options: CallOptions, progress: Progress | None
    ) -> pb.UpdateWeightsResponse:
        # Exported only now: a storage exported to nobody stays allocated after the trainer
        # frees it (torch's ref counter waits for a consumer that never comes).
        started_s = time.perf_counter()
        try:
            export = export_cuda_ipc(update, self._cuda_ipc_exports)
        except (RuntimeError, ValueError) as error:
            # An allocator that cannot share (cudaMallocAsync), too many storages: "auto" goes
            # another way, "cuda_ipc" raises it.
            raise _CannotExport() from error
        header = pb.WeightsHeader()
        header.CopyFrom(update.header)
        header.cuda_ipc.CopyFrom(export.source)
        head_bytes = len(update.layout()[0])
        if progress is not None:
            progress(0, update.total_bytes)
        # The head as chunks, in one unary call where the server has it; the data section stays
        # where it is. `export` holds the memory until the call has ended, whatever its outcome.
        messages = list(update.messages(header, 0, head_bytes))
        called_s = time.perf_counter()
        reply = self._server.send_small(messages, options)
        export.keep_alive.clear()
        # Where the client's part of a colocated update goes (bench_gpu_weights.py prints it).
        _LOG.debug(
            CUDA_IPC_CLIENT_LINE,
            update.header.version,
            called_s - started_s,
            len(export.source.buffers),
            len(export.source.spans),
            time.perf_counter() - called_s,
            reply.seconds,
        )
        if progress is not None:
            progress(update.total_bytes, update.total_bytes)
        return reply

    # ---- gRPC streams ------------------------------------------------------------------------

    def _send_grpc(
        self,
        update: UpdateFile,
        options: CallOptions,
        streams: int,
        progress: Progress | None,
        cancel: threading.Event | None = None,
    ) -> pb.UpdateWeightsResponse:
        parts: list[_Messages] = []  # each stream's messages, with what they raised
        try:
            return self._send_parts(update, options, streams, progress, cancel, parts)
        except grpc.RpcError:
            for part in parts:
                if part.error is not None:
                    raise part.error from None
            raise

    def _send_parts(
        self,
        update: UpdateFile,
        options: CallOptions,
        streams: int,
        progress: Progress | None,
        cancel: threading.Event | None,
        parts: list[_Messages],
    ) -> pb.UpdateWeightsResponse:
        ranges = _part_ranges(update, streams)
        if len(ranges) == 1:
            parts.append(_Messages(update.messages(progress=progress), cancel))
            return self._calls[0](parts[0], timeout=options.timeout_s, metadata=options.metadata)
        calls = self._stream_calls(len(ranges))
        update_id = uuid.uuid4().hex
        sent = _PartProgress(progress, update.total_bytes, len(ranges))
        futures = []
        for index, (begin, end) in enumerate(ranges):
            header = pb.WeightsHeader()
            header.CopyFrom(update.header)
            header.parallel.update_id = update_id
            header.parallel.streams = len(ranges)
            header.parallel.index = index
            header.parallel.begin = begin
            header.parallel.end = end
            parts.append(_Messages(update.messages(header, begin, end, sent.part(index)), cancel))
            futures.append(
                calls[index].future(parts[-1], timeout=options.timeout_s, metadata=options.metadata)
            )
        return _settle(futures)

    def _stream_calls(self, count: int) -> list[StartCall]:
        while len(self._calls) < count:
            call, channel = self._open_stream()
            self._calls.append(call)
            self._extra_channels.append(channel)
        return self._calls[:count]


class _CannotExport(Exception):
    """torch could not export the tensors' memory (its cause says why); nothing was sent."""


def _cancelled() -> Cancelled:
    return Cancelled("the update was cancelled while being sent; the server applied nothing")


class _Messages:
    """An update's request messages as gRPC's sending thread takes them, keeping what they
    raised: gRPC ends such a call with UNKNOWN "Exception iterating requests!" and drops the
    exception, which hid the client's own error (a tensor resized while being sent, a progress
    callback that raised). Ends with Cancelled once `cancel` is set."""

    def __init__(self, messages: Iterator[bytes], cancel: threading.Event | None) -> None:
        self._messages = messages
        self._cancel = cancel
        self.error: BaseException | None = None

    def __iter__(self) -> _Messages:
        return self

    def __next__(self) -> bytes:
        try:
            if self._cancel is not None and self._cancel.is_set():
                raise _cancelled()
            return next(self._messages)
        except StopIteration:
            raise
        except BaseException as error:
            self.error = error
            raise


class _WrittenStream:
    """The UpdateWeights call of a streamed shared-memory update: the header once the file's
    head is written, then a SharedMemoryWritten whenever another _WRITTEN_STEP_BYTES are final
    (and at the end, with the file's size)."""

    def __init__(
        self,
        call: StartCall,
        options: CallOptions,
        header: Callable[[], bytes],
        total_bytes: int,
        cancel: threading.Event | None = None,
    ) -> None:
        self._cancel = cancel
        self._call = call
        self._options = options
        self._header = header
        self._total_bytes = total_bytes
        self._messages: SimpleQueue[bytes | None] = SimpleQueue()
        self._future: grpc.Future | None = None
        self._sent = 0

    def written_to(self, end: int) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise _cancelled()  # the writer abandons the stream: the server applies nothing
        if self._future is None:  # the memfd is sized and the head is in it: start the call
            self._messages.put(self._header())
            self._future = self._call.future(
                iter(self._messages.get, None),
                timeout=self._options.timeout_s,
                metadata=self._options.metadata,
            )
        if end == self._total_bytes or end - self._sent >= _WRITTEN_STEP_BYTES:
            written = pb.SharedMemoryWritten(bytes=end)
            self._messages.put(pb.UpdateWeightsRequest(shm_written=written).SerializeToString())
            self._sent = end

    def result(self) -> pb.UpdateWeightsResponse:
        assert self._future is not None
        self._messages.put(None)  # the end of the stream
        return self._future.result()

    def abandon(self) -> None:
        """Writing failed: end the stream (the server refuses the short file) and the call."""
        self._messages.put(None)
        if self._future is not None:
            self._future.cancel()


def _unreachable(error: grpc.RpcError, prefix: str) -> bool:
    """The server could not open the memfd or the CUDA IPC handles at all (its refusal starts
    with `prefix`): nothing was staged, sending again another way is safe."""
    return error.code() == grpc.StatusCode.FAILED_PRECONDITION and (
        error.details() or ""
    ).startswith(prefix)


def _part_ranges(update: UpdateFile, streams: int) -> list[tuple[int, int]]:
    """Byte ranges of the file for `streams` parts: part 0 holds the head, the data is split
    evenly at chunk_bytes multiples; fewer parts when the file is small."""
    total_bytes = update.total_bytes
    head_bytes = len(update.layout()[0])
    step = update.chunk_bytes
    data_chunks = -(-(total_bytes - head_bytes) // step)
    parts = max(1, min(streams, data_chunks))
    bounds = [0]
    for i in range(1, parts):
        cut = head_bytes + (data_chunks * i // parts) * step
        if bounds[-1] < cut < total_bytes:
            bounds.append(cut)
    return list(zip(bounds, [*bounds[1:], total_bytes], strict=True))


class _PartProgress:
    """One progress callback for several streams: the sum of what each has sent."""

    def __init__(self, progress: Progress | None, total_bytes: int, parts: int) -> None:
        self._progress = progress
        self._total_bytes = total_bytes
        self._sent = [0] * parts

    def part(self, index: int) -> Progress | None:
        if self._progress is None:
            return None

        def report(sent: int, _total: int) -> None:
            self._sent[index] = sent
            assert self._progress is not None
            self._progress(sum(self._sent), self._total_bytes)

        return report


def _settle(futures: list[grpc.Future]) -> pb.UpdateWeightsResponse:
    """The parts' common reply. On a failure, cancel the parts still sending and raise the
    leader's error: the server fails every part with the status of the part that failed first,
    and names it."""
    settled = threading.Event()
    for future in futures:
        future.add_done_callback(lambda _: settled.set())
    while True:
        settled.wait()
        settled.clear()
        failed = [f for f in futures if f.done() and (f.cancelled() or f.exception() is not None)]
        if failed or all(f.done() for f in futures):
            break
    if not failed:
        return futures[0].result()
    for future in futures[1:]:
        future.cancel()
    try:
        return futures[0].result()  # raises the leader's error
    except grpc.FutureCancelledError:
        raise failed[0].exception() from None  # type: ignore[misc]
