"""Pipelined staging into a device arena: host bytes pass a small ring, copies run asynchronously.

For a model on a CUDA device the staging copy lives on that device (arena.py). Bytes that arrive
in host memory (a gRPC chunk, a shared-memory mapping, a gloo bucket) are copied into a slot of
a small ring of page-locked host buffers, and from there into the device arena by a copy issued
with `non_blocking=True` on the arena's own copy stream; the call returns at once, so the next
bytes arrive while the DMA engine moves these. A slot is taken again only after the event
recorded behind its copy completed. Bytes that are already on a device (feed_tensor) are copied
device to device on the same stream, with no pass through the host.

Coalescing. A lane's consecutive host bytes fill its current slot until the slot is full, and
only then is the slot copied: one copy and one event per slot, however small the pieces that
arrived (gRPC chunks are a fraction of a slot; each launch costs tens of microseconds on a GPU).
A partly filled slot stays with its lane between calls (keyed by the position of the lane's next
byte) and is copied when the lane's next bytes do not continue it (device bytes, bytes a plane
wrote itself), when its lane ends (`flush`), or at `synchronize`. Bytes count as arrived only
once their slot's copy was issued, so a tensor's checks never run before its last bytes left a
slot. At most all but one of the ring's slots are held this way, so a lane always gets a slot.

Value checks run on the device too: the checks come as byte ranges of the data section planned
from the head (verify.py, `plan_check_groups`: one per run of same-dtype tensors), and once every
byte of a range was copied (by whichever lane brought its last bytes; all copies go through the
one copy stream, so the check is ordered after them), its reduction is enqueued on the copy
stream without waiting for it (`DeferredValues`); `finish` synchronises once and reads every
result at once. The host work per update is per slot and per range, not per tensor.

The same code runs with a "device" arena on the CPU (no stream, no pinning, every copy
synchronous), which is how the CPU tests exercise the ring, the routing and the checks.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .timings import UpdateTimings

__all__ = ["RING_SLOTS", "SLOT_BYTES", "DevicePipeline", "SlotRing"]

# The ring's bound: RING_SLOTS x SLOT_BYTES of host memory (page-locked for CUDA). Eight slots
# keep every shared-memory copy lane (at most four) filling one slot while the DMA engine drains
# another; 8 MiB is large enough that a copy's launch cost is small next to its transfer.
RING_SLOTS = 8
SLOT_BYTES = 8 << 20


@dataclass(eq=False)
class _Slot:
    tensor: torch.Tensor  # uint8, SLOT_BYTES, pinned for CUDA
    array: np.ndarray  # the same memory, for numpy's GIL-free copies
    event: torch.cuda.Event | None = None  # recorded behind the slot's last copy


@dataclass(eq=False)
class _Fill:
    """A slot a lane is filling: data-section bytes [start, start + filled), not yet copied."""

    slot: _Slot
    start: int
    filled: int = 0
    held: bool = False  # kept by its lane between calls (SlotRing.hold)


class SlotRing:
    """At most `slots` host buffers of `slot_bytes`, allocated on first use and kept.

    `acquire` hands out a free slot, or waits for the oldest slot in flight to finish its copy;
    `release` puts a slot back, in flight behind an event on `stream` (or free at once when
    there is no stream: the copy already happened). A slot is only held while one caller fills
    it from memory that is already there, so waiting for a slot never waits on a network.
    """

    def __init__(
        self, *, pin_memory: bool, slots: int = RING_SLOTS, slot_bytes: int = SLOT_BYTES
    ) -> None:
        self.pin_memory = pin_memory
        self.slot_bytes = slot_bytes
        self._limit = slots
        self._allocated = 0
        self._free: deque[_Slot] = deque()
        self._in_flight: deque[_Slot] = deque()  # in the order their copies were issued
        self._held: dict[int, _Slot] = {}  # partly filled slots kept by lanes, by id
        self._changed = threading.Condition()
        self.copies = 0  # slot copies issued (release with bytes in the slot), ever

    @property
    def slots(self) -> int:
        """The most slots the ring allocates."""
        return self._limit

    @property
    def allocated_bytes(self) -> int:
        """Host memory the ring holds (at most slots x slot_bytes)."""
        with self._changed:
            return self._allocated * self.slot_bytes

    def acquire(self) -> _Slot:
        with self._changed:
            while True:
                if self._free:
                    return self._free.popleft()
                if self._allocated < self._limit:
                    self._allocated += 1
                    break
                if self._in_flight:
                    slot = self._in_flight.popleft()
                    event = slot.event
                    if event is None:
                        return slot
                    # Wait outside the lock: other lanes may release meanwhile.
                    self._changed.release()
                    try:
                        event.synchronize()
                    finally:
                        self._changed.acquire()
                    return slot
                self._changed.wait()  # every slot is being filled right now
        try:
            tensor = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        except BaseException:
            with self._changed:
                self._allocated -= 1
                self._changed.notify()
            raise
        return _Slot(tensor, tensor.numpy())

    def hold(self, slot: _Slot) -> bool:
        """Keep an acquired slot across calls (partly filled) if at least one other slot stays
        free to take; False: the caller must copy and release it now."""
        with self._changed:
            if len(self._held) + 1 >= self._limit:
                return False
            self._held[id(slot)] = slot
            return True

    def release(
        self, slot: _Slot, stream: torch.cuda.Stream | None, *, copied: bool = True
    ) -> None:
        """Put `slot` back (held or not); `copied`: a copy out of it was just issued."""
        if stream is not None:
            if slot.event is None:
                slot.event = torch.cuda.Event()
            slot.event.record(stream)
        with self._changed:
            self._held.pop(id(slot), None)
            self.copies += copied
            (self._in_flight if stream is not None else self._free).append(slot)
            self._changed.notify()

    def reclaim(self) -> None:
        """Free the slots still held by an update that ended without copying them (a failed
        one): a new update starts, so no lane of the old one fills them any more."""
        with self._changed:
            self._free.extend(self._held.values())
            self._held.clear()
            self._changed.notify_all()

    def clear(self) -> None:
        """Drop every slot (none may be in use; the copy stream was synchronised)."""
        with self._changed:
            self._free.clear()
            self._in_flight.clear()
            self._held.clear()
            self._allocated = 0


class DevicePipeline:
    """One update's copies into a device arena, and the value checks behind them.

    Thread-safe: lanes on several threads route bytes at once (each its own byte range).
    `complete(index)` is called, with the copy stream current, once every byte of
    checked[index] (a data-section range [begin, end); the ranges are in order and disjoint) was
    copied: it enqueues that range's checks (never waits for the device).
    """

    def __init__(
        self,
        arena: torch.Tensor,
        segments: Sequence[tuple[int, int, int]],
        checked: Sequence[tuple[int, int]],
        *,
        ring: SlotRing,
        stream: torch.cuda.Stream | None,
        complete: Callable[[int], None],
        timings: UpdateTimings | None = None,
    ) -> None:
        # timings: lane-seconds of ring waits, host copies, copy launches and check launches.
        self._timings = UpdateTimings() if timings is None else timings
        self.arena = arena
        self._segments = tuple(segments)
        self._segment_begins = [begin for begin, _, _ in segments]
        self._checked = tuple(checked)
        self._checked_ends = [end for _, end in checked]
        self._missing = [end - begin for begin, end in checked]  # bytes not yet copied, per range
        self._ring = ring
        self._stream = stream
        self._complete = complete
        self._lock = threading.Lock()
        # Device sources still being read by the copy stream: kept alive until their event.
        self._held: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
        # Each lane's partly filled slot, by the data-section position of the lane's next byte
        # (lanes never overlap, so the position names the lane).
        self._open: dict[int, _Fill] = {}
        # The arena's lease is exclusive: a slot an earlier update still holds is abandoned.
        ring.reclaim()

    @property
    def device(self) -> torch.device:
        return self.arena.device

    @property
    def slot_bytes(self) -> int:
        """The ring's slot size: host bytes handed over in pieces of it cost one copy each."""
        return self._ring.slot_bytes

    def host_bytes(self, position: int, source: np.ndarray) -> None:
        """Data-section bytes [position, position + len(source)) from host memory: into the
        lane's current ring slot, which is copied asynchronously into the arena once full (or
        at `flush` / `synchronize`). `source` may be reused when this returns."""
        size = len(source)
        if size == 0:
            return
        with self._lock:
            fill = self._open.pop(position, None)  # the slot this lane left partly filled
        done = 0
        waited_s = copied_s = launched_s = 0.0
        acquired = copies = launches = 0
        slot_bytes = self._ring.slot_bytes
        try:
            while done < size:
                if fill is None:
                    asked_s = time.perf_counter()
                    fill = _Fill(self._ring.acquire(), position + done)
                    waited_s += time.perf_counter() - asked_s
                    acquired += 1
                take = min(size - done, slot_bytes - fill.filled)
                copying_s = time.perf_counter()
                np.copyto(
                    fill.slot.array[fill.filled : fill.filled + take], source[done : done + take]
                )
                copied_s += time.perf_counter() - copying_s
                copies += 1
                fill.filled += take
                done += take
                if fill.filled == slot_bytes:
                    full, fill = fill, None
                    launched_s += self._launch(full)
                    launches += 1
            if fill is not None:
                last, fill = fill, None
                if last.held or self._ring.hold(last.slot):
                    last.held = True
                    with self._lock:
                        self._open[position + size] = last
                else:  # every other slot is held by a lane: copy this one now
                    launched_s += self._launch(last)
                    launches += 1
        finally:
            if fill is not None:  # an error: hand the slot back uncopied
                self._ring.release(fill.slot, None, copied=False)
            self._timings.add("ring_wait", waited_s, acquired)
            self._timings.add("host_copy", copied_s, copies)
            self._timings.add("copy_launch", launched_s, launches)

    def flush(self, position: int) -> None:
        """The lane whose next byte would be at data-section `position` ended (or goes on
        without the ring): copy its partly filled slot now."""
        with self._lock:
            fill = self._open.pop(position, None)
        if fill is not None:
            self._timings.add("copy_launch", self._launch(fill))

    def _launch(self, fill: _Fill) -> float:
        """Issue the copy of a filled slot into the arena, hand the slot back, count its bytes
        as arrived (which may enqueue checks); the seconds the launch took."""
        started_s = time.perf_counter()
        try:
            with self._on_stream():
                self._copy_runs(fill.start, fill.slot.tensor[: fill.filled])
        finally:
            self._ring.release(fill.slot, self._stream)
        launched_s = time.perf_counter() - started_s
        self._arrived(fill.start, fill.filled)
        return launched_s

    def copies_directly(self, source: torch.Tensor, held_host: bool = False) -> bool:
        """Whether `tensor_bytes` copies `source` into the arena without the ring: a device
        tensor, or, with `held_host`, page-locked host memory (a registered shared-memory
        mapping, page_lock.py in client/protocol) bound for a CUDA arena, which the DMA engine
        reads as it is."""
        if source.device.type != "cpu":
            return True
        return held_host and self._stream is not None and source.is_pinned()

    def tensor_bytes(self, position: int, source: torch.Tensor, held_host: bool = False) -> None:
        """Data-section bytes from a 1-D uint8 tensor: host tensors go through the ring (reusable
        at once); device tensors, and page-locked host tensors the caller holds unchanged
        (`held_host`, `copies_directly`), are copied straight into the arena and must stay
        unchanged until `synchronize` (they are kept alive until their copy completed)."""
        if not self.copies_directly(source, held_host):
            self.host_bytes(position, source.numpy())
            return
        self.flush(position)  # the lane goes on without the ring: its slot's bytes go first
        started_s = time.perf_counter()
        if self._stream is None:  # a CPU arena: the copy is synchronous
            self._copy_runs(position, source)
        else:
            if source.device.type != "cpu":
                # The source was written on its producer's stream (a receive, a kernel).
                self._stream.wait_stream(torch.cuda.current_stream(source.device))
            with self._on_stream():
                self._copy_runs(position, source)
            event = torch.cuda.Event()
            event.record(self._stream)
            with self._lock:
                while self._held and self._held[0][0].query():
                    self._held.popleft()
                self._held.append((event, source))
        self._timings.add("copy_launch", time.perf_counter() - started_s)
        self._arrived(position, len(source))

    def written(self, position: int, size: int) -> None:
        """Bytes a data plane wrote into the arena itself (Lane.destination), on the caller's
        current stream: the checks of the tensors they complete are ordered after them."""
        self.flush(position)  # the lane goes on without the ring: its slot's bytes go first
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._arrived(position, size)

    def synchronize(self) -> None:
        """Copy every partly filled slot, then wait for every copy and check issued so far."""
        with self._lock:
            positions = list(self._open)
        for position in positions:
            self.flush(position)
        if self._stream is not None:
            self._stream.synchronize()
        with self._lock:
            self._held.clear()

    def read_back(self, begin: int, end: int) -> Iterator[np.ndarray]:
        """Arena bytes [begin, end) in host memory, piece by piece (through one ring slot)."""
        if self.arena.device.type == "cpu":
            yield self.arena[begin:end].numpy()
            return
        slot = self._ring.acquire()
        try:
            for start in range(begin, end, self._ring.slot_bytes):
                take = min(end - start, self._ring.slot_bytes)
                with self._on_stream():
                    slot.tensor[:take].copy_(self.arena[start : start + take], non_blocking=True)
                assert self._stream is not None
                self._stream.synchronize()
                yield slot.array[:take]
        finally:
            self._ring.release(slot, None, copied=False)

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _copy_runs(self, position: int, source: torch.Tensor) -> None:
        """Copy data-section bytes [position, position + len(source)) into the arena, one copy
        per segment of constant shift they touch (stream.py, plan_arena)."""
        index = bisect.bisect_right(self._segment_begins, position) - 1
        done, size = 0, len(source)
        while done < size:
            _, segment_end, shift = self._segments[index]
            take = min(size - done, segment_end - position)
            start = position + shift
            self.arena[start : start + take].copy_(source[done : done + take], non_blocking=True)
            done += take
            position += take
            index += 1

    def _arrived(self, position: int, size: int) -> None:
        """Count the copied bytes per checked range; enqueue the checks of every range now
        complete.

        Every copy into a range was issued on the copy stream before its lane counted it, so
        the checks, issued after the count that completed the range, run after all of them."""
        end = position + size
        completed = []
        with self._lock:
            index = bisect.bisect_right(self._checked_ends, position)
            while index < len(self._checked) and self._checked[index][0] < end:
                begin, stop = self._checked[index]
                overlap = min(end, stop) - max(position, begin)
                if overlap > 0:
                    self._missing[index] -= overlap
                    if self._missing[index] == 0:
                        completed.append(index)
                index += 1
        if completed:
            started_s = time.perf_counter()
            with self._on_stream():
                for index in completed:
                    self._complete(index)
            self._timings.add("check_group", time.perf_counter() - started_s, len(completed))
