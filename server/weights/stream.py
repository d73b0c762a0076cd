"""Receive a safetensors file as byte ranges and route its bytes into one staging arena.

The 8-byte length and the JSON header (the "head") are buffered and parsed once; then every data
byte is copied exactly once, from where it arrived (a gRPC chunk, a shared-memory mapping, a
broadcast bucket) straight into an arena sized for the whole data section (no whole-file blob,
no per-tensor blobs, no safetensors.load). Tensors are views into the arena in their wire dtype
and shape. The arena is a reusable StagingArena when the caller leases one (the server does: see
arena.py for why and for the memory bound), else a fresh host buffer.

Host or device. A host arena (a model on the CPU) is written with numpy copies and checked
element by element as below. A device arena (a model on a CUDA device) is written through
pipeline.py: host bytes via a pinned ring and asynchronous copies, device bytes (`feed_tensor`)
device to device, and each tensor is checked on the device once all its bytes are in; `finish`
waits once for all of it. Either way the head is parsed on the host, and crc32 and a streamed
sha256 cover the host bytes as they pass.

Lanes. The file arrives as one or more *lanes*: byte ranges [begin, end) of the file that tile
it, each fed in order from its own thread (one lane for a single gRPC stream; one per stream for
parallel streams; one per copying thread for shared memory). The lane that begins at 0 carries
the head; the others wait until it is parsed. In a host arena, each lane checks the values of
the elements that lie wholly inside its range as soon as they arrive (the bytes are still in the
CPU cache), and `finish` checks the few elements that straddle two lanes. Copies go through
numpy, which releases the GIL, so lanes on different threads copy and check in parallel.

In place. A plane that already holds the whole data section in device memory that stays
unchanged until the update is applied (CUDA IPC buffers of a trainer on this host) offers it
before the head (`offer_in_place`); when the head allows (`_in_place_allowed`: a device arena on
that device, no shifted segment, aligned, no sha256) no arena is taken at all, the plane hands
the memory over (`Lane.place`), the checks run on it and the staged tensors are its views, so
apply copies it straight into the model: one device-to-device pass instead of two, and no
staging copy of the weights on the device.

The arena mirrors the data section byte for byte, so a run of bytes lands with one memcpy,
except where a tensor would start at an offset that is not a multiple of its itemsize
(safetensors does not require alignment, and torch cannot view misaligned bytes as wider
elements). From such a tensor on, the arena is shifted by a few bytes; each run of constant
shift is a "segment", and a run is copied once per segment it touches.

This module is the lanes and the stager (the head, the order of bytes, the end);
file_data.py is what they write into and check with (`FileData`, the check cursors).
"""

from __future__ import annotations

import bisect
import hashlib
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from ...client.protocol.errors import InvalidArgument
from .arena import StagingArena
from .checksum import crc32 as crc32_of
from .file_data import CheckCursor, DeviceChecks, FileData, StreamChecks, check_byte_tensor
from .header import PREFIX_BYTES, StreamEntry, parse_header
from .layout import ArenaLayout, VerifiedHead, plan_arena
from .pipeline import DevicePipeline
from .timings import UpdateTimings

__all__ = [
    "ArenaLayout",
    "Lane",
    "SafetensorsStager",
    "StagedFile",
    "StreamChecks",
    "VerifiedHead",
    "plan_arena",
]

Bytes = bytes | bytearray | memoryview | np.ndarray
# The widest itemsize safetensors has (F64, I64, U64): memory offered in place at a multiple of
# it keeps every tensor of a shift-free layout aligned to its own itemsize.
_MAX_ITEMSIZE = 8


@dataclass(frozen=True)
class StagedFile:
    """A completely received and verified file: tensors are views into one arena."""

    entries: tuple[StreamEntry, ...]
    tensors: Mapping[str, torch.Tensor]
    total_bytes: int
    on_device: bool = False  # staged in a device arena (pipeline.py), not in host memory
    in_place: bool = False  # the tensors are views of a plane's own memory (Lane.place)


class Lane:
    """One byte range [begin, end) of the file, fed in order (one thread at a time)."""

    def __init__(
        self, stager: SafetensorsStager, begin: int, end: int, *, hash_bytes: bool
    ) -> None:
        self.begin = begin
        self.end = end
        self.position = begin  # file offset of the next byte
        self._stager = stager
        self._digest = hashlib.sha256() if hash_bytes else None
        self._cursor: CheckCursor | DeviceChecks | None = None

    @property
    def complete(self) -> bool:
        return self.position == self.end

    def feed(self, offset: int, data: Bytes, crc32: int | None = None) -> None:
        """Take the next bytes of this lane; offset must equal the lane's position."""
        source = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        size = len(source)
        self._check_next(offset, size)
        if crc32 is not None and crc32_of(source) != crc32:
            raise InvalidArgument(f"crc32 mismatch in the chunk at offset {offset}")
        if self._digest is not None:
            self._digest.update(source)
        self._stager.check_open()
        self.position += size
        if self._cursor is None:  # the head is not parsed yet: only the lane at 0 is here
            source = self._stager.take_head(source)
            if self._stager.head_parsed:
                # Now, not with the first data byte: a broadcast receives the data section
                # through `destination`, which needs the cursor (else every receive posted
                # before the first commit took a bounce buffer and a copy).
                self._cursor = self._stager.cursor(self)
            if not len(source):
                if self.complete and not self._stager.head_parsed:
                    error = InvalidArgument(
                        f"part 0 ends at {self.end}, inside the file's head: it must hold the "
                        "whole head (the 8-byte length and the JSON header)"
                    )
                    self._stager.fail(error)
                    raise error
                return
        assert self._cursor is not None  # bytes past the head: the head was parsed
        data_state = self._stager.data
        position = self.position - len(source) - data_state.data_start
        data_state.route(position, source)
        if self.complete and data_state.pipeline is not None:
            data_state.pipeline.flush(position + len(source))  # its last slot: copy it now
        self._cursor.advance(position + len(source))

    def feed_tensor(self, offset: int, data: torch.Tensor, *, held_host: bool = False) -> None:
        """Take the next bytes of this lane as a 1-D contiguous uint8 tensor on any device (no
        crc32); the same contract as `feed`. Device bytes bound for a device arena are copied
        device to device; see SafetensorsStager.feed_tensor for when `data` may be reused.
        held_host: host bytes in page-locked memory that the caller keeps unchanged until the
        update finishes (the shared-memory plane's registered mapping): a CUDA arena copies
        them by DMA, without the ring; otherwise host bytes are copied before this returns."""
        check_byte_tensor(data)
        if data.device.type == "cpu" and not (held_host and self._copied_directly(data)):
            self.feed(offset, data.numpy())
            return
        while self._cursor is None and len(data):  # the head is parsed on the host
            head = data[: self._stager.head_bytes_missing() or len(data)].cpu().numpy()
            self.feed(offset, head)
            offset, data = offset + len(head), data[len(head) :]
        if not len(data):
            return
        size = len(data)
        self._check_next(offset, size)
        if self._digest is not None:  # documented cost: a host copy of the bytes
            self._digest.update(data.cpu().numpy())
        self._stager.check_open()
        self.position += size
        assert self._cursor is not None
        data_state = self._stager.data
        position = offset - data_state.data_start
        data_state.route_tensor(position, data, held_host)
        self._cursor.advance(position + size)

    def place(self, source: torch.Tensor) -> None:
        """The whole data section, where the plane that offered it in place holds it (1-D
        uint8, at the device and storage offset offered; unchanged until the update is
        applied): checked there and staged as its views, no copy (see the module). Only for the
        lane over the whole file, right after the head, when `file_data.in_place`."""
        data = self._stager.data
        whole = self.begin == 0 and self.end == self._stager.total_bytes
        if not (data.in_place and whole and self.position == data.data_start):
            raise AssertionError("place: only the whole file's lane, after the head, in place")
        self._stager.check_open()
        self._stager.place(source)
        self.position = self.end

    def _copied_directly(self, data: torch.Tensor) -> bool:
        """Held host bytes past the head that the device arena copies as they are (page-locked
        memory, pipeline.py `copies_directly`) rather than through `feed`'s ring."""
        pipeline = self._stager.data.pipeline if self._cursor is not None else None
        return pipeline is not None and pipeline.copies_directly(data, held_host=True)

    def _check_next(self, offset: int, size: int) -> None:
        if offset != self.position:
            raise InvalidArgument(
                f"chunk at offset {offset}, expected {self.position}: chunks must arrive in "
                "order, each exactly once"
            )
        if size == 0:
            raise InvalidArgument(f"empty chunk at offset {offset}")
        if offset + size > self.end:
            what = "total_bytes" if self.end == self._stager.total_bytes else "its part's end"
            raise InvalidArgument(
                f"chunk at offset {offset} with {size} bytes runs past {what} {self.end}"
            )

    @property
    def file_data(self) -> FileData:
        """The parsed head (entries, where the data section starts) and the arena."""
        return self._stager.data

    def destination(self, offset: int, size: int) -> torch.Tensor | None:
        """Where file bytes [offset, offset + size) of this lane go in the arena, as a writable
        uint8 tensor, when they are one run there (one segment) and the head is parsed; else
        None (use `feed`). `offset` may be ahead of the lane's position (a receive posted
        before the previous bytes are committed). The run is on the arena's device: a plane
        writes it only with a writer of that device (gloo: host memory; NCCL: the GPU).

        For data planes that can receive straight into memory (a broadcast): write the bytes
        there, then `commit(size)` in order; that skips the copy `feed` makes.
        """
        if self._cursor is None or size <= 0:
            return None
        if offset < self.position or offset + size > self.end:
            return None
        data = self._stager.data
        return data.run(offset - data.data_start, size)

    def commit(self, size: int) -> None:
        """The `size` bytes at `destination(position, size)` were written: hash them (when the
        SHA-256 is checked: the digest covers what landed), check them, move on."""
        self._stager.check_open()
        data = self._stager.data
        position = self.position - data.data_start
        if self._digest is not None:
            landed = data.run(position, size)
            assert landed is not None, "commit only what destination handed out"
            self._digest.update(landed.cpu().numpy())
        self.position += size
        data.written(position, size)
        assert self._cursor is not None
        self._cursor.advance(position + size)

    def start_in_data(self, timeout_s: float | None) -> None:
        """For a lane that does not begin at 0: wait for the head, check the range's place."""
        self._stager.wait_for_head(timeout_s)
        if self.begin < self._stager.data.data_start:
            raise InvalidArgument(
                f"a part that begins at {self.begin} is inside the file's head (it ends at "
                f"{self._stager.data.data_start}); part 0 must hold the whole head"
            )
        self._cursor = self._stager.cursor(self)

    def hexdigest(self) -> str | None:
        return None if self._digest is None else self._digest.hexdigest()


class SafetensorsStager:
    """Takes the file's bytes as lanes; `finish` returns the staged tensors once all arrived.

    `feed` is the one-lane form (a single ordered stream). Any error is final: a stager that
    raised is dropped (`fail` wakes lanes waiting for the head), never fed again.
    """

    def __init__(
        self,
        total_bytes: int,
        checks: StreamChecks,
        *,
        max_header_bytes: int,
        sha256_hex: str | None = None,
        arena: StagingArena | None = None,
        timings: UpdateTimings | None = None,
    ) -> None:
        # arena: a leased, reusable buffer (warm memory); None allocates a fresh one.
        # timings: where the arena's take, the pipeline and finish add their seconds.
        self.timings = UpdateTimings() if timings is None else timings
        self.total_bytes = total_bytes
        self._reusable_arena = arena
        self._checks = checks
        self._max_header_bytes = max_header_bytes
        self._sha256_hex = sha256_hex
        self._head = bytearray()  # the length prefix and JSON header, until parsed
        self._header_bytes: int | None = None
        self._data: FileData | None = None
        self._verified: VerifiedHead | None = None  # the head's, once parsed (or reused)
        self._lanes: list[Lane] = []
        self._lanes_lock = threading.Lock()
        self._head_ready = threading.Event()  # set when the head is parsed, or on failure
        self._failure: BaseException | None = None
        self._single: Lane | None = None
        # (device, storage offset) of the data section a plane offered in place, if any.
        self._in_place_offer: tuple[torch.device, int] | None = None
        self._in_place_views: dict | None = None  # the plane's memory of its views (offer)

    # ---- lanes ---------------------------------------------------------------------------

    def lane(self, begin: int, end: int) -> Lane:
        """A new lane for file bytes [begin, end); lanes must not overlap."""
        if not 0 <= begin < end <= self.total_bytes:
            raise InvalidArgument(
                f"byte range [{begin}, {end}) is not inside the file of {self.total_bytes} bytes"
            )
        with self._lanes_lock:
            for other in self._lanes:
                if begin < other.end and other.begin < end:
                    raise InvalidArgument(
                        f"byte range [{begin}, {end}) overlaps [{other.begin}, {other.end})"
                    )
            # Streaming SHA-256 only for a lone lane over the whole file; otherwise at finish.
            whole = begin == 0 and end == self.total_bytes
            lane = Lane(self, begin, end, hash_bytes=whole and self._sha256_hex is not None)
            self._lanes.append(lane)
        return lane

    @property
    def received_bytes(self) -> int:
        return sum(lane.position - lane.begin for lane in self._lanes)

    def feed(self, offset: int, data: Bytes, crc32: int | None = None) -> None:
        """Take the next chunk of a single ordered stream; offset must equal the bytes so far."""
        if self._single is None:
            self._single = self.lane(0, self.total_bytes)
        self._single.feed(offset, data, crc32)

    def feed_tensor(self, offset: int, data: torch.Tensor) -> None:
        """`feed` for bytes held in a tensor (1-D, contiguous, uint8, on any device; no crc32)."""
        if self._single is None:
            self._single = self.lane(0, self.total_bytes)
        self._single.feed_tensor(offset, data)

    def fail(self, error: BaseException) -> None:
        """Mark the stager failed: lanes waiting for the head wake up and raise."""
        if self._failure is None:
            self._failure = error
        self._head_ready.set()

    def check_open(self) -> None:
        if self._failure is not None:
            raise InvalidArgument(f"the update failed elsewhere: {self._failure}")

    # ---- head ----------------------------------------------------------------------------

    @property
    def head_parsed(self) -> bool:
        return self._data is not None

    @property
    def data(self) -> FileData:
        assert self._data is not None
        return self._data

    def take_head(self, source: np.ndarray) -> np.ndarray:
        """Buffer head bytes (lane 0 only); parse when complete; return what is left over."""
        try:
            while len(source) and self._data is None:
                take = self._head_target() - len(self._head)
                self._head += source[:take].tobytes()
                source = source[take:]
                self._advance_head()
        except BaseException as error:
            self.fail(error)
            raise
        return source

    def wait_for_head(self, timeout_s: float | None) -> None:
        if not self._head_ready.wait(timeout_s):
            raise InvalidArgument(f"part 0 did not deliver the file's head within {timeout_s:g} s")
        self.check_open()

    def head_bytes_missing(self) -> int:
        """Bytes the head still needs before the next step of its parsing (0 once parsed)."""
        return 0 if self._data is not None else self._head_target() - len(self._head)

    def offer_in_place(
        self, device: torch.device, storage_offset: int, views: dict | None = None
    ) -> None:
        """A plane that will hold the whole data section in memory of `device`, at byte
        `storage_offset` of its storage, offers to hand it over (`Lane.place`) instead of
        feeding it; whether it is taken shows in `data.in_place` once the head is parsed.
        Before the head only.

        views: a dict the plane keeps with that memory (kept CUDA IPC buffers), where the
        staged views are remembered for the next update that places the same memory under the
        same head; they live, and go, with the memory they view. None: made every update."""
        assert self._data is None, "offer_in_place before the head"
        self._in_place_offer = (torch.device(device), storage_offset)
        self._in_place_views = views

    def let_go(self) -> None:
        """Drop the references to memory staged in place (once the update is applied or has
        failed; the staged views, if any, hold their own). The stager and its lanes refer to
        each other, and a refusal's traceback holds them: left to the garbage collector, a
        trainer's CUDA IPC memory would stay mapped past the plane's exit."""
        if self._data is not None:
            self._data.let_go()

    def place(self, source: torch.Tensor) -> None:
        """Lane.place's work: the data section's memory becomes the arena; every check group
        is launched on it (it is all there)."""
        data = self.data
        offer = self._in_place_offer
        assert offer is not None and self._reusable_arena is not None
        check_byte_tensor(source)
        data_bytes = self.total_bytes - data.data_start
        if (source.device, source.storage_offset()) != offer or len(source) != data_bytes:
            raise InvalidArgument(
                f"in place: {len(source)} bytes on {source.device} at storage offset "
                f"{source.storage_offset()}, but {data_bytes} bytes on {offer[0]} at "
                f"{offer[1]} were offered"
            )
        placing_s = time.perf_counter()
        data.arena = source
        data.pipeline = self._pipeline(source, data, self._reusable_arena)
        data.pipeline.written(0, data_bytes)
        self.timings.add("in_place", time.perf_counter() - placing_s)

    def cursor(self, lane: Lane) -> CheckCursor | DeviceChecks:
        data = self.data
        if data.on_device or data.in_place:
            return DeviceChecks()
        low = max(lane.begin - data.data_start, 0)
        return CheckCursor(data, self._checks, low, lane.end - data.data_start)

    def _head_target(self) -> int:
        return PREFIX_BYTES if self._header_bytes is None else PREFIX_BYTES + self._header_bytes

    def _advance_head(self) -> None:
        if self._header_bytes is None and len(self._head) == PREFIX_BYTES:
            header_bytes = int.from_bytes(self._head, "little")
            if header_bytes > self._max_header_bytes:
                raise InvalidArgument(
                    f"safetensors header of {header_bytes} bytes is over the limit of "
                    f"{self._max_header_bytes}"
                )
            if PREFIX_BYTES + header_bytes > self.total_bytes:
                raise InvalidArgument(
                    f"safetensors header of {header_bytes} bytes does not fit in total_bytes "
                    f"{self.total_bytes}"
                )
            self._header_bytes = header_bytes
        if self._header_bytes is not None and len(self._head) == self._head_target():
            self._start_data()

    def _start_data(self) -> None:
        assert self._header_bytes is not None
        data_start = PREFIX_BYTES + self._header_bytes
        data_bytes = self.total_bytes - data_start
        # Verify names, shapes and dtypes against the model before allocating anything big.
        head = self._verify_head(bytes(self._head[PREFIX_BYTES:]), data_bytes)
        entries, layout = head.entries, head.layout
        reusable = self._reusable_arena
        if self._in_place_allowed(layout, data_bytes):
            assert self._in_place_offer is not None
            placeholder = torch.empty(0, dtype=torch.uint8, device=self._in_place_offer[0])
            data = FileData(entries, data_start, placeholder, layout, in_place=True)
        else:
            taking_s = time.perf_counter()
            if reusable is not None:
                arena = reusable.take(layout.arena_bytes)
            else:
                arena = torch.empty(layout.arena_bytes, dtype=torch.uint8)
            self.timings.add("arena_take", time.perf_counter() - taking_s)
            data = FileData(entries, data_start, arena, layout)
            if reusable is not None and reusable.staged_on_device:
                data.pipeline = self._pipeline(arena, data, reusable)
        self._verified = head
        self._data = data
        self._head_ready.set()

    def _pipeline(
        self, arena: torch.Tensor, data: FileData, reusable: StagingArena
    ) -> DevicePipeline:
        """The device pipeline into `arena` (the arena's buffer, or memory staged in place),
        whose completed ranges launch the device check groups."""
        checks = self._checks
        groups = checks.device_groups()
        return DevicePipeline(
            arena,
            data.layout.segments,
            [(group.data_begin, group.data_end) for group in groups],
            ring=reusable.ring,
            stream=reusable.copy_stream,
            complete=lambda index: data.launch_check(checks, groups[index], index),
            timings=self.timings,
        )

    def _in_place_allowed(self, layout: ArenaLayout, data_bytes: int) -> bool:
        """Whether the offered memory can be staged in place: a device arena on its device
        (the checks and apply are the device path's), every tensor viewable where it lies (no
        shifted segment, an offset that keeps each tensor aligned to its itemsize), no SHA-256
        (it hashes bytes as they are fed), and something to stage."""
        offer, reusable = self._in_place_offer, self._reusable_arena
        if offer is None or reusable is None or reusable.device is None or not data_bytes:
            return False
        device, storage_offset = offer
        return (
            device == reusable.device
            and layout.arena_bytes == data_bytes  # shifts only grow: no segment is shifted
            and storage_offset % _MAX_ITEMSIZE == 0
            and self._sha256_hex is None
        )

    def _verify_head(self, raw: bytes, data_bytes: int) -> VerifiedHead:
        """The head's entries, layout and checks: those of the arena's last head when this one
        is the same (VerifiedHead), else parsed and checked now (and kept by the arena)."""
        reusable = self._reusable_arena
        key = None if reusable is None else self._checks.head_key()  # None: nowhere to keep it
        known = None if reusable is None else reusable.verified_head
        if key is not None and known is not None and known.matches(raw, data_bytes, key):
            self._checks.reuse(known.verified)
            return known
        checking_s = time.perf_counter()
        entries = parse_header(raw, data_bytes)
        self._checks.check_header(entries)
        layout = plan_arena(entries, data_bytes)
        verified = None if key is None else self._checks.verified
        head = VerifiedHead(raw, data_bytes, key, entries, layout, verified)
        if reusable is not None and key is not None:
            reusable.verified_head = head
        self.timings.add("head_check", time.perf_counter() - checking_s)
        return head

    # ---- the end ---------------------------------------------------------------------------

    def finish(self) -> StagedFile:
        """Check that every byte arrived and the SHA-256 matches; return the staged tensors."""
        received = self.received_bytes
        if received != self.total_bytes or self._data is None:
            raise InvalidArgument(f"stream ended after {received} of {self.total_bytes} bytes")
        data = self._data
        if data.pipeline is not None:
            waiting_s = time.perf_counter()
            data.pipeline.synchronize()  # every copy and check issued: one wait for all
            settling_s = time.perf_counter()
            self._checks.settle()
            self.timings.add("finish_sync", settling_s - waiting_s)
            self.timings.add("settle", time.perf_counter() - settling_s)
        else:
            self._check_lane_boundaries(data)
        if self._sha256_hex is not None and self._sha256() != self._sha256_hex:
            raise InvalidArgument("sha256 of the received file does not match header.sha256")
        return StagedFile(
            data.entries,
            self._staged_views(data),
            self.total_bytes,
            on_device=data.on_device,
            in_place=data.in_place,
        )

    def _staged_views(self, data: FileData) -> Mapping[str, torch.Tensor]:
        """The staged tensors (views of the arena): those of the arena's last update when the
        head and the arena buffer are the same (~300 views made once, not per update)."""
        head = self._verified
        assert head is not None  # set with the data
        if data.in_place:
            return self._in_place_staged_views(data, head)
        buffer = (data.arena.untyped_storage().data_ptr(), data.arena.numel())
        views = head.views.get(buffer)
        if views is None:
            views = MappingProxyType(data.tensors())
            # The arena keeps this head: one buffer's views at a time; never views of memory
            # staged in place (they would keep the plane's memory, e.g. a trainer's, mapped).
            if head.key is not None:
                head.views.clear()
                head.views[buffer] = views
        return views

    def _in_place_staged_views(
        self, data: FileData, head: VerifiedHead
    ) -> Mapping[str, torch.Tensor]:
        """The views of memory staged in place: those the plane remembers (offer_in_place's
        `views`) when they were made under this head over this very memory, else made now
        (and remembered there: one entry, the last)."""
        remembered, memory = self._in_place_views, (data.arena.data_ptr(), data.arena.numel())
        last = None if remembered is None else remembered.get("last")
        if last is not None and last[0] is head and last[1] == memory and head.key is not None:
            return last[2]
        views = MappingProxyType(data.tensors())
        if remembered is not None:
            remembered["last"] = (head, memory, views)
        return views

    def _check_lane_boundaries(self, data: FileData) -> None:
        """Check the elements cut in two by a boundary between lanes (no lane checked them)."""
        for lane in self._lanes:
            boundary = lane.begin - data.data_start
            if boundary <= 0:
                continue
            index = bisect.bisect_right(data.entry_ends, boundary)
            if index >= len(data.entries):
                continue
            entry = data.entries[index]
            itemsize = entry.dtype.itemsize
            if entry.begin < boundary and (boundary - entry.begin) % itemsize:
                element = (boundary - entry.begin) // itemsize
                self._checks.check_elements(entry, data.elements(index, element, element + 1))

    def _sha256(self) -> str:
        if len(self._lanes) == 1 and self._lanes[0].hexdigest() is not None:
            return self._lanes[0].hexdigest()  # type: ignore[return-value]
        # Several lanes: hash the staged copy itself (head, then each segment in file order), so
        # the digest covers exactly the bytes that will be applied. A device arena is read back
        # through a ring slot for it: one device-to-host pass over the data section.
        data = self.data
        digest = hashlib.sha256(self._head)
        for begin, end, shift in data.layout.segments:
            for piece in data.host_bytes(begin + shift, end + shift):
                digest.update(piece)
        return digest.hexdigest()
