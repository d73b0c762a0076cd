"""The CUDA IPC data plane: an update whose data section is CUDA memory of a trainer on this host.

The call (a stream, or one UpdateWeightsAtOnce: the client's choice) carries the header, whose
CudaIpcSource lists the trainer's buffers (one per CUDA storage, as torch's
`UntypedStorage._share_cuda_()` describes it) and the spans that tile the file's data section, then
the file's head as chunks. The server copies every span device to device into the stager
(`UpdateStager.feed_tensor`), where it is verified like any other byte.

Order, so that nothing is opened for an update that will be refused:

1. `check_source` (when the plane is picked): the source's shape: counts, field sizes, spans
   that follow each other up to total_bytes and lie inside their buffer. INVALID_ARGUMENT.
2. `CudaIpcPlane.__init__`: the trainer's host is this host, the models are on CUDA.
   FAILED_PRECONDITION.
3. `receive`: the head arrives on the stream and is verified (names, shapes, dtypes against the
   model); the spans must begin where the data section begins; every buffer's GPU must be one
   this process sees (by UUID). Only then are the handles opened (an event the trainer recorded
   is waited for), the spans copied, and, in `__exit__` (after the swap, before the reply), the
   storages dropped, which closes the handles.

In place. A data section that is one span of one buffer on the models' GPU (weights flattened
on the trainer's side, flat_weights.py) is offered to the stager in place (stream.py): when the
head allows it, nothing is copied into a staging arena at all; the value checks read the
trainer's buffer, and apply copies it straight into the model's parameters between batches.
That is one device-to-device pass per update instead of two, and no staging copy of the
weights on the GPU (which a trainer sharing the GPU would otherwise pay for). The lifetime
contract is the same as for a staged copy (the memory stays allocated and unchanged until the
reply), it is only read later: by apply rather than by receive. ROLLSERVE_CUDA_IPC_IN_PLACE=0
stages every update (for comparing the two).

Kept open. A trainer sends every update from the same memory (its flattened weights, its
pack buffer), and opening a CUDA IPC handle maps the trainer's allocation into this process
(cudaIpcOpenMemHandle), closing it unmaps it and synchronises: work per update that does not
depend on the update (SGLang and UCX keep opened handles for the same reason). `KeptIpcBuffers`
keeps the storages of each role's last KEPT_UPDATES successful updates open, keyed by what names
the memory (this process's device, the handle, the storage's offset and size: a CUDA IPC handle
names one allocation, and a new allocation gets a new handle even at the same address), so the
next update of the same buffers (or of a trainer alternating two) opens nothing. Only memory of
cudaMalloc is kept (`keepable`): a handle of a trainer's expandable segments
(expandable_segments:True) may come out byte for byte the same for new pages, so those are
opened and closed per update. They are closed
when the role's later updates no longer name them, after KEEP_S without a CUDA IPC update, and
at shutdown. A storage that may be
kept is opened without torch's ref counter, and every counter an update brings is given back
when the update ends (as for a buffer it never opened): the trainer's allocator may free or
reuse its memory after the reply exactly as without keeping, and a trainer that exits leaves no
count behind (torch would warn of one). Memory freed and allocated again comes with a new handle,
so it is opened anew; the stale mapping is never read and goes once the role's later updates
no longer name it, or KEEP_S later. ROLLSERVE_CUDA_IPC_KEEP=0 opens (with the counter) and closes
every buffer per update.

A handle that does not open (the trainer exited or freed the memory) is FAILED_PRECONDITION
starting "cuda_ipc: ", like every refusal that says this plane cannot work here (the client's
"auto" then sends another way; nothing was staged). The old weights keep serving either way.

torch's producer-side ref counter: `_share_cuda_` sets a counter in a shared-memory file of the
trainer to 1, and the trainer's allocator keeps the storage's memory until it is back to 0. A
storage opened here decrements it when dropped (torch's deleter); a buffer never opened is
released in `__exit__` (`_release_ipc_counter`; a refusal after step 2), or by `refused` (a
server whose models are not on CUDA, one that does not take cuda_ipc, a third update at once),
so a refused update does not pin the trainer's memory. Not given back: a header the server
never read (UNAVAILABLE while it loads or stops), or one of another host (its file is not
here). The counter's file name and slot are checked in step 1: the release writes to that
slot. A buffer without a counter (a storage the trainer handed over
before, whose counter an earlier update gave back) has nothing to give back: torch's deleter
finds no file of that (empty) name and does nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from types import TracebackType

import torch

from ...client.protocol.cuda_ipc import (
    EVENT_HANDLE_BYTES,
    MAX_BUFFERS,
    MAX_HANDLE_BYTES,
    MAX_SPANS,
    REF_COUNTER_NAME,
    REF_COUNTER_SLOTS,
    device_uuid,
)
from ...client.protocol.errors import FailedPrecondition, InvalidArgument
from ...client.protocol.transports import CUDA_IPC
from ...v1 import rollout_pb2 as pb
from ..capture_guard import apart_from_captures
from .header import PREFIX_BYTES
from .staging import Request, UpdateStager, receive_head_only
from .timings import UpdateTimings

__all__ = [
    "KEEP_S",
    "KEPT_UPDATES",
    "PIECE_BYTES",
    "CUDA_MALLOC_HANDLE",
    "BufferKey",
    "CudaIpcPlane",
    "KeptIpcBuffers",
    "buffer_key",
    "can_open_cuda_ipc",
    "check_source",
    "keepable",
    "keeps_buffers",
]

_LOG = logging.getLogger(__name__)
# Into a host arena (a CUDA server whose device could not hold the staging copy), feed_tensor
# takes a span in pieces of at most this many bytes: each piece is a device-to-host temporary.
# A device arena takes each span whole: one device-to-device copy, whose value checks are
# launched per check group behind it (the copy stream runs copies and checks in order anyway,
# so pieces only added host launches: 16 per GB).
PIECE_BYTES = 64 << 20
_REFUSED = "cuda_ipc: "  # the prefix of the refusals after which the client may go another way
IN_PLACE_ENV = "ROLLSERVE_CUDA_IPC_IN_PLACE"  # "0": stage every update (see the module)
KEEP_ENV = "ROLLSERVE_CUDA_IPC_KEEP"  # "0": open and close every buffer per update
# Kept buffers are closed after this long without a CUDA IPC update (as a shared-memory file's
# mapping is: shared_memory.py), so the memory of a trainer that stopped sending goes back soon.
KEEP_S = 30.0

# torch's shareable handle (CUDACachingAllocator's shareIpcHandle) begins with a version byte
# and a type: 'c' for memory of cudaMalloc (a cudaIpcMemHandle, which names one allocation: a
# new one gets a new handle even at the same address), 'e' for an expandable segment's pages
# (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; exported as file descriptors, whose
# numbers, and so the handle's bytes, may come out the same after the trainer's allocator
# released its pages and mapped new ones). Only the first kind is kept open across updates.
CUDA_MALLOC_HANDLE = b"\x02c"


def keepable(buffer: pb.CudaIpcBuffer) -> bool:
    """Whether `buffer` may stay open for later updates (see the module): its handle names one
    allocation for the allocation's life (CUDA_MALLOC_HANDLE), and there is no event of the
    trainer's to wait for at every update."""
    return not buffer.event_sync_required and buffer.handle[:2] == CUDA_MALLOC_HANDLE


# (this process's device index, handle, storage offset, storage bytes): one storage of one
# allocation of the trainer's.
BufferKey = tuple[int, bytes, int, int]


def buffer_key(buffer: pb.CudaIpcBuffer, index: int) -> BufferKey:
    """What names `buffer`'s memory, opened on this process's device `index`."""
    return (index, bytes(buffer.handle), buffer.storage_offset, buffer.storage_bytes)


# The buffers of this many of a role's latest updates stay open: a trainer that alternates two
# buffers (writing the next weights into one while the server reads the other) opens nothing.
KEPT_UPDATES = 2

# One kept buffer: the opened storage, and the staged views of memory placed from it (stream.py's
# in-place views, remembered with the storage they view and gone with it).
_Kept = tuple[torch.UntypedStorage, dict]


class KeptIpcBuffers:
    """The opened storages of each role's last KEPT_UPDATES successful CUDA IPC updates (see
    the module): `take` one for the next update, `keep` an update's set (closing the role's
    buffers that no kept update names any more), `release` all. Thread-safe; a storage taken by
    an update in flight stays open until that update drops it, whatever is released meanwhile
    (a storage closes with its last reference)."""

    def __init__(self, keep_s: float = KEEP_S) -> None:
        self._keep_s = keep_s
        self._lock = threading.Lock()
        # role -> the sets of its latest updates, newest first (a buffer in the newest only)
        self._by_role: dict[int, list[dict[BufferKey, _Kept]]] = {}
        self._timer: threading.Timer | None = None
        self._last_kept_s = 0.0

    def take(self, role: int, key: BufferKey) -> torch.UntypedStorage | None:
        kept = self._find(role, key)
        return None if kept is None else kept[0]

    def views(self, role: int, key: BufferKey) -> dict | None:
        """The views remembered with the kept storage of `key` (None: not kept)."""
        kept = self._find(role, key)
        return None if kept is None else kept[1]

    def keep(self, role: int, opened: Mapping[BufferKey, _Kept]) -> None:
        """`opened` (the buffers of the role's latest update, each with its views) becomes the
        role's newest set; the storages no kept set holds any more close once nothing else
        refers to them."""
        with self._lock:
            sets = self._by_role.pop(role, [])
            newest = dict(opened)
            older = [{k: v for k, v in s.items() if k not in newest} for s in sets]
            kept = [s for s in [newest, *older][:KEPT_UPDATES] if s]
            dropped = older[KEPT_UPDATES - 1 :]
            if kept:
                self._by_role[role] = kept
            self._last_kept_s = time.monotonic()
            if self._timer is None and self._by_role:  # one timer, not a thread per update
                self._arm(self._keep_s)
        _close(dropped)  # outside the lock: closing synchronises the device

    def _find(self, role: int, key: BufferKey) -> _Kept | None:
        with self._lock:
            for kept in self._by_role.get(role, []):
                if key in kept:
                    return kept[key]
            return None

    def release(self) -> None:
        """Close every kept buffer (server stop). Not apart from captures (capture_guard.py):
        the engine has closed by then, and an update stuck in a collective may hold the guard
        for its timeout, past the stop's bound."""
        with self._lock:
            dropped, self._by_role = self._by_role, {}
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        dropped.clear()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(kept) for sets in self._by_role.values() for kept in sets)

    def _arm(self, after_s: float) -> None:
        self._timer = threading.Timer(after_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        """The timer: release everything after keep_s without a `keep`, else wait the rest."""
        with self._lock:
            self._timer = None
            idle_s = time.monotonic() - self._last_kept_s
            if idle_s < self._keep_s:
                self._arm(self._keep_s - idle_s)
                return
            dropped, self._by_role = self._by_role, {}
        _close(dropped)


def _close(dropped: list | dict) -> None:
    """Drop kept storages (each closes once nothing else refers to it), apart from any CUDA
    graph capture (capture_guard.py)."""
    with apart_from_captures(torch.device("cuda")):
        dropped.clear()


def keeps_buffers() -> bool:
    """Whether servers keep CUDA IPC buffers open between updates (ROLLSERVE_CUDA_IPC_KEEP)."""
    return os.environ.get(KEEP_ENV, "1") != "0"


def can_open_cuda_ipc(device: torch.device) -> bool:
    """Whether a server whose models are on `device` takes CUDA IPC updates: on CUDA only."""
    return device.type == "cuda" and torch.cuda.is_available()


def check_source(source: pb.CudaIpcSource, total_bytes: int) -> None:
    """The source's shape, before anything is opened; InvalidArgument naming the field."""
    buffers, spans = source.buffers, source.spans
    if len(buffers) > MAX_BUFFERS:
        raise InvalidArgument(f"header.cuda_ipc.buffers: at most {MAX_BUFFERS}, got {len(buffers)}")
    if len(spans) > MAX_SPANS:
        raise InvalidArgument(f"header.cuda_ipc.spans: at most {MAX_SPANS}, got {len(spans)}")
    for index, buffer in enumerate(buffers):
        _check_buffer(f"header.cuda_ipc.buffers[{index}]", buffer)
    position = None
    for index, span in enumerate(spans):
        field = f"header.cuda_ipc.spans[{index}]"
        if index == 0 and span.begin <= PREFIX_BYTES:
            raise InvalidArgument(f"{field}.begin: {span.begin} is inside the file's head")
        if position is not None and span.begin != position:
            what = "a gap" if span.begin > position else "an overlap"
            raise InvalidArgument(
                f"{field}.begin: {span.begin}, but the previous span ends at {position} "
                f"({what}): spans tile the data section in file order"
            )
        if span.end <= span.begin:
            raise InvalidArgument(f"{field}: end {span.end} is not above begin {span.begin}")
        if span.end > total_bytes:
            raise InvalidArgument(f"{field}.end: {span.end} is past total_bytes {total_bytes}")
        if span.buffer >= len(buffers):
            raise InvalidArgument(
                f"{field}.buffer: {span.buffer}, but there are {len(buffers)} buffers"
            )
        size = buffers[span.buffer].storage_bytes
        if span.offset > size or span.end - span.begin > size - span.offset:
            raise InvalidArgument(
                f"{field}: bytes [{span.offset}, {span.offset + span.end - span.begin}) are not "
                f"inside buffers[{span.buffer}] ({size} bytes)"
            )
        position = span.end
    if position is not None and position != total_bytes:
        raise InvalidArgument(
            f"header.cuda_ipc.spans: the last ends at {position}, not at total_bytes "
            f"{total_bytes}: spans tile the data section"
        )
    unused = set(range(len(buffers))) - {span.buffer for span in spans}
    if unused:
        raise InvalidArgument(
            f"header.cuda_ipc.buffers[{min(unused)}]: no span reads it ({len(unused)} unused)"
        )


def _check_buffer(field: str, buffer: pb.CudaIpcBuffer) -> None:
    uuid = buffer.device_uuid
    if len(uuid) != 32 or any(c not in "0123456789abcdef" for c in uuid):
        raise InvalidArgument(f"{field}.device_uuid: 32 lowercase hex digits, got {uuid!r}")
    if not 0 < len(buffer.handle) <= MAX_HANDLE_BYTES:
        raise InvalidArgument(
            f"{field}.handle: 1 to {MAX_HANDLE_BYTES} bytes, got {len(buffer.handle)}"
        )
    if buffer.storage_bytes == 0:
        raise InvalidArgument(f"{field}.storage_bytes: an empty storage has nothing to share")
    if buffer.storage_offset >= 1 << 62 or buffer.storage_bytes >= 1 << 62:
        raise InvalidArgument(f"{field}: storage_offset and storage_bytes must be below 2^62")
    counter = buffer.ref_counter_handle
    if counter and not REF_COUNTER_NAME.fullmatch(counter):
        raise InvalidArgument(
            f"{field}.ref_counter_handle: empty, or one name in /dev/shm ('/' and 1 to 254 of "
            "[A-Za-z0-9._-])"
        )
    if buffer.ref_counter_offset >= REF_COUNTER_SLOTS:
        raise InvalidArgument(
            f"{field}.ref_counter_offset: 0 to {REF_COUNTER_SLOTS - 1}, got "
            f"{buffer.ref_counter_offset}"
        )
    if buffer.event_sync_required and len(buffer.event_handle) != EVENT_HANDLE_BYTES:
        raise InvalidArgument(
            f"{field}.event_handle: {EVENT_HANDLE_BYTES} bytes when event_sync_required, got "
            f"{len(buffer.event_handle)}"
        )


class CudaIpcPlane:
    """One update from CUDA IPC buffers (a DataPlane of planes.py)."""

    name = CUDA_IPC

    def __init__(
        self,
        header: pb.WeightsHeader,
        *,
        device: torch.device,
        host_id: str,
        kept: KeptIpcBuffers | None = None,
    ) -> None:
        # device: the models'; host_id: this server's Health.shm_host_id; kept: the buffers
        # kept open from earlier updates (None: open and close every buffer).
        source = header.cuda_ipc
        check_source(source, header.total_bytes)
        if not host_id or source.host_id != host_id:
            # Its counters' files are another host's (or namespace's): nothing to give back.
            raise FailedPrecondition(
                f"{_REFUSED}the trainer is on another host or PID namespace (host_id "
                f"{source.host_id!r}, this server's Health.shm_host_id {host_id!r}): CUDA IPC "
                "works between processes of one host only; use 'shm', 'grpc' or 'dist'"
            )
        self._source = source
        self._total_bytes = header.total_bytes
        self._device = device
        self._kept = kept
        self._role = header.target
        self._indices: list[int] = []  # this process's device index of each buffer
        self._opened: list[torch.UntypedStorage | None] = []  # by buffer, once opened
        self._reused: set[int] = set()  # buffers whose storage was kept open by an earlier update
        self._counted: set[int] = set()  # buffers opened with their counter (not to be kept)
        self._views: dict[int, dict] = {}  # buffer -> where stream.py remembers in-place views
        self._timings = UpdateTimings()  # the update's, once receive has its stager
        self._released: list[bool] = [False] * len(source.buffers)  # counter given back
        if not can_open_cuda_ipc(device):
            self.refused()
            raise FailedPrecondition(
                f"{_REFUSED}this server's models are on {device}: it opens CUDA IPC handles "
                "only when they are on a CUDA device; use 'shm', 'grpc' or 'dist'"
            )

    def __enter__(self) -> CudaIpcPlane:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Keep the opened buffers for the next update (after a success, when buffers are
        kept) or close them (drop the storages), and give back every counter no storage's
        deleter gives back; before the reply, whatever happened (apart from any CUDA graph
        capture: closing synchronises with the device, capture_guard.py)."""
        with apart_from_captures(self._device):
            try:
                self._close_or_keep(error)
            finally:
                self._release_counters()

    def _close_or_keep(self, error: BaseException | None) -> None:
        opened = {n: s for n, s in enumerate(self._opened) if s is not None}
        for number in opened:
            # Opened with its counter (buffers not kept): torch's deleter decrements it when
            # the storage closes. Opened without (kept, see the module): given back below.
            self._released[number] = number in self._counted
        if error is not None and opened:
            # Copies of a failed update may still be in flight on the stager's stream: they
            # must end before the trainer may free the memory.
            for index in {self._device_index(), *self._indices}:
                torch.cuda.synchronize(index)
        keeper = self._kept if error is None else None  # a failed update keeps nothing
        buffers = self._source.buffers
        kept = [n for n in opened if keeper is not None and keepable(buffers[n])]
        if keeper is not None and opened:
            keeper.keep(self._role, {
                buffer_key(buffers[n], self._indices[n]): (opened[n], self._views.get(n, {}))
                for n in kept
            })  # fmt: skip
        self._views = {}
        # The last references here: dropping them closes the handles that are not kept
        # (torch's deleter syncs the device's current stream, decrements the trainer's counter,
        # closes the mapping).
        closing_s = time.perf_counter()
        closed = sum(1 for n in opened if n not in kept and n not in self._reused)
        opened.clear()
        self._opened = []
        if closed:
            self._timings.add("ipc_handle_close", time.perf_counter() - closing_s, closed)

    def finished(self, response: pb.UpdateWeightsResponse) -> None:
        return None

    def refused(self) -> None:
        """Refused before it was entered (DataPlane.refused): nothing was opened; every
        counter the header brings is given back, so the trainer's allocator may free that
        memory once it drops the tensors (torch keeps a shared storage's memory while its
        counter is above 0)."""
        self._release_counters()

    def receive(self, stager: UpdateStager, requests: Iterator[Request]) -> None:
        """The head from the stream, then every span device to device into the stager."""
        self._timings = stager.timings
        spans = self._source.spans
        if self._in_place_candidate():
            views = self._in_place_views(spans[0].buffer)
            stager.offer_in_place(self._model_device(), spans[0].offset, views)
        lane = receive_head_only(stager, requests, CUDA_IPC)
        data_start = lane.file_data.data_start
        stager.timings.lap("head")
        first = spans[0].begin if spans else self._total_bytes
        if first != data_start:
            raise InvalidArgument(
                f"header.cuda_ipc.spans[0].begin: {first}, but the data section begins at "
                f"{data_start}"
            )
        self._indices = self._map_devices()
        self._open_all()
        stager.timings.lap("open")
        piece_bytes = self._total_bytes if lane.file_data.on_device else PIECE_BYTES
        storage = whole = None
        try:
            for span in spans:
                storage = self._opened[span.buffer]
                assert storage is not None
                whole = torch.empty(0, dtype=torch.uint8, device=storage.device)
                whole.set_(storage, 0, (storage.nbytes(),))
                if lane.file_data.in_place:  # the one span: checked and applied where it is
                    lane.place(whole[span.offset : span.offset + span.end - span.begin])
                    continue
                for begin in range(span.begin, span.end, piece_bytes):
                    size = min(piece_bytes, span.end - begin)
                    start = span.offset + begin - span.begin
                    lane.feed_tensor(begin, whole[start : start + size])
        finally:
            # No reference of this frame may outlive the call (a traceback keeps the frame):
            # the handles close when __exit__ drops the storages.
            storage = whole = None

    def _in_place_candidate(self) -> bool:
        """Whether to offer the data section in place: one span of one buffer on the models'
        GPU (the stager decides with the head whether it takes it), unless switched off."""
        if os.environ.get(IN_PLACE_ENV, "1") == "0" or len(self._source.spans) != 1:
            return False
        buffer = self._source.buffers[self._source.spans[0].buffer]
        return buffer.device_uuid == device_uuid(self._device_index())

    def _in_place_views(self, number: int) -> dict | None:
        """Where the stager may remember its views of buffer `number` placed in place: the
        dict kept with the buffer's open storage (the views of an update whose head and memory
        are the last one's are then not made again: ~300 views per update), a new one for the
        kept set (buffers kept), or None (every update makes its views)."""
        if self._kept is None or not keepable(self._source.buffers[number]):
            return None
        key = buffer_key(self._source.buffers[number], self._device_index())
        views = self._kept.views(self._role, key)
        self._views[number] = {} if views is None else views
        return self._views[number]

    def _model_device(self) -> torch.device:
        return torch.device("cuda", self._device_index())

    # ---- opening and closing ----------------------------------------------------------------

    def _device_index(self) -> int:
        index = self._device.index
        return torch.cuda.current_device() if index is None else index

    def _map_devices(self) -> list[int]:
        """This process's index of each buffer's GPU, by UUID; FailedPrecondition for a GPU it
        does not see (CUDA_VISIBLE_DEVICES hides it)."""
        visible = {device_uuid(index): index for index in range(torch.cuda.device_count())}
        indices = []
        for number, buffer in enumerate(self._source.buffers):
            index = visible.get(buffer.device_uuid)
            if index is None:
                raise FailedPrecondition(
                    f"{_REFUSED}buffers[{number}] is on GPU {buffer.device_uuid} (the trainer's "
                    f"cuda:{buffer.device}), which this server does not see"
                )
            indices.append(index)
        return indices

    def _open_all(self) -> None:
        """Open every buffer's handle (after waiting for its event); FailedPrecondition when one
        does not open. Storages opened before the failure are closed by __exit__."""
        self._opened = [None] * len(self._source.buffers)
        events_s = handles_s = 0.0
        for number, (buffer, index) in enumerate(
            zip(self._source.buffers, self._indices, strict=True)
        ):
            kept = None
            may_keep = self._kept is not None and keepable(buffer)
            if may_keep:
                kept = self._kept.take(self._role, buffer_key(buffer, index))
            if kept is not None:
                self._opened[number] = kept
                self._reused.add(number)
                continue
            try:
                started_s = time.perf_counter()
                if buffer.event_sync_required:
                    # The trainer's event after its last write (a handle that also fails when
                    # the trainer is gone). Waited on the host: the copies run on the stager's
                    # own stream, which a stream wait on ours would not order.
                    torch.cuda.Event.from_ipc_handle(index, buffer.event_handle).synchronize()
                waited_s = time.perf_counter()
                storage = torch.UntypedStorage._new_shared_cuda(
                    index,
                    buffer.handle,
                    buffer.storage_bytes,
                    buffer.storage_offset,
                    # Kept storages hold no counter: the update gives it back (_release_counters).
                    b"" if may_keep else buffer.ref_counter_handle,
                    0 if may_keep else buffer.ref_counter_offset,
                    buffer.event_handle,
                    False,  # the event is waited for above
                )
                events_s += waited_s - started_s
                handles_s += time.perf_counter() - waited_s
            except (RuntimeError, ValueError, TypeError) as error:
                reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
                raise FailedPrecondition(
                    f"{_REFUSED}buffers[{number}] (GPU {buffer.device_uuid}) did not open: "
                    f"{reason}; the trainer must keep its memory alive until the reply (did it "
                    "exit or free the tensors?)"
                ) from None
            self._opened[number] = storage
            if not may_keep:
                self._counted.add(number)  # torch's deleter gives its counter back
        opened = len(self._opened) - len(self._reused)
        if opened:
            self._timings.add("ipc_event_wait", events_s, opened)
            self._timings.add("ipc_handle_open", handles_s, opened)
        if self._reused:
            self._timings.add("ipc_handle_kept", 0.0, len(self._reused))

    def _release_counters(self) -> None:
        """Give back the ref counter of every buffer whose storage does not (never opened, or
        opened without it to be kept); best effort: a trainer that exited took its counters
        with it."""
        for number, buffer in enumerate(self._source.buffers):
            if self._released[number] or not buffer.ref_counter_handle:
                continue
            self._released[number] = True
            try:
                torch.UntypedStorage._release_ipc_counter(
                    buffer.ref_counter_handle,
                    buffer.ref_counter_offset,
                    # torch ignores it (a counter is host memory); not looked up on a CPU server
                    device=self._indices[number] if self._indices else None,
                )
            except Exception as error:  # the trainer is gone: nothing to give back
                _LOG.debug("cuda_ipc: buffers[%d]: ref counter not released: %s", number, error)
