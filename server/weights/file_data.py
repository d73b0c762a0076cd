"""The data section of an update being staged: where its bytes land and how they are checked.

`FileData` is a parsed head (its entries, where the data section starts, the arena layout) with
the arena its bytes land in: a host buffer written with numpy copies, a device buffer written
through pipeline.py's DevicePipeline, or memory a data plane staged in place (stream.py,
`Lane.place`). It routes a lane's bytes into the arena, hands out byte runs for planes that
write the arena themselves, and makes the staged tensors as views of it. `CheckCursor` checks a
host arena's values as a lane's bytes arrive; a device arena's (and one staged in place) are
checked by the pipeline per group instead (`DeviceChecks` is the cursor that does nothing).
`StreamChecks` is what stream.py's stager and these need of the verification (verify.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

from ...client.protocol.errors import InvalidArgument
from .header import StreamEntry
from .layout import ArenaLayout
from .pipeline import DevicePipeline
from .verify import CheckGroup

__all__ = ["CheckCursor", "DeviceChecks", "FileData", "StreamChecks", "check_byte_tensor"]


class StreamChecks(Protocol):
    """Verification hooks; each raises InvalidArgument to stop the stream."""

    def check_header(self, entries: Sequence[StreamEntry]) -> None:
        """Called once the header is parsed, before the arena is allocated."""

    def check_elements(self, entry: StreamEntry, values: torch.Tensor) -> None:
        """Called on runs of a tensor's elements (1-D, wire dtype) as soon as they arrived.

        The runs of one tensor cover each element exactly once; they may come from several
        threads at once (one per lane), never twice for the same element. Host arenas only.
        """

    def device_groups(self) -> Sequence[CheckGroup]:
        """Device arenas (pipeline.py), after check_header: the value checks, each a run of
        tensors in data order that is checked once every byte of [data_begin, data_end)
        arrived (verify.py, plan_check_groups)."""

    def launch_check(self, index: int, raw: torch.Tensor) -> None:
        """Device arenas: enqueue the checks of device_groups()[index] over `raw`, its arena
        bytes (1-D uint8 on the arena's device), with the copy stream current, without waiting
        for them. Called from any lane's thread."""

    def settle(self) -> None:
        """Device arenas: called once by `finish` after the copy stream was synchronised;
        raises the first failure of the launched checks, in data order."""

    def head_key(self) -> Hashable:
        """What the header's checks depend on besides the head's bytes (and the model, which
        is the arena's): a head seen before with an equal key is not checked again."""

    @property
    def verified(self) -> object:
        """What check_header derived, for `reuse` by a later update of the same head."""

    def reuse(self, verified: object) -> None:
        """Instead of check_header: take what it derived for the same head and head_key."""


class FileData:
    """The parsed head and the arena: what every lane writes into once the head is known."""

    def __init__(
        self,
        entries: tuple[StreamEntry, ...],
        data_start: int,
        arena: torch.Tensor,
        layout: ArenaLayout,
        pipeline: DevicePipeline | None = None,
        *,
        in_place: bool = False,
    ) -> None:
        self.entries = entries
        self.data_start = data_start  # file offset of the data section
        self.layout = layout
        self.arena = arena
        # pipeline: the arena is a device arena, written through it (pipeline.py).
        self.pipeline = pipeline
        # in_place: the "arena" is the plane's own memory, handed over by Lane.place (until
        # then an empty placeholder, and no pipeline).
        self.in_place = in_place
        # A host arena's bytes as numpy (the host lanes write through it); a device arena has
        # none: its pipeline is set by the stager once this object exists (its hooks name it).
        self.arena_np = arena.numpy() if arena.device.type == "cpu" and not in_place else None
        self.segment_begins = [begin for begin, _, _ in layout.segments]
        self.entry_ends = [entry.end for entry in entries]

    @property
    def on_device(self) -> bool:
        return self.pipeline is not None

    def let_go(self) -> None:
        """Drop every reference to memory staged in place (after a refusal)."""
        if self.in_place:
            self.arena = torch.empty(0, dtype=torch.uint8, device=self.arena.device)
            self.pipeline = None

    def route(self, position: int, source: np.ndarray) -> None:
        """Copy data-section bytes [position, position + len(source)) into the arena (through
        the pipeline's ring for a device arena; the values are checked there)."""
        if self.pipeline is not None:
            self.pipeline.host_bytes(position, source)
            return
        assert self.arena_np is not None
        segments = self.layout.segments
        index = bisect.bisect_right(self.segment_begins, position) - 1
        done = 0
        while done < len(source):
            _, segment_end, shift = segments[index]
            take = min(len(source) - done, segment_end - position)
            start = position + shift
            np.copyto(self.arena_np[start : start + take], source[done : done + take])
            done += take
            position += take
            index += 1

    def route_tensor(self, position: int, source: torch.Tensor, held_host: bool = False) -> None:
        """`route` for bytes in a 1-D uint8 tensor on any device: device to device into a device
        arena (page-locked host bytes too, with `held_host`: pipeline.py); a host arena takes a
        host copy of device bytes."""
        if self.pipeline is not None:
            self.pipeline.tensor_bytes(position, source, held_host)
        else:
            self.route(position, source.cpu().numpy())

    def written(self, position: int, size: int) -> None:
        """Bytes a data plane wrote into `run`'s memory itself (see Lane.commit)."""
        if self.pipeline is not None:
            self.pipeline.written(position, size)

    def host_bytes(self, begin: int, end: int) -> Iterator[np.ndarray]:
        """Arena bytes [begin, end) in host memory, in order (read back from a device arena)."""
        if self.pipeline is not None:
            yield from self.pipeline.read_back(begin, end)
        else:
            assert self.arena_np is not None
            yield self.arena_np[begin:end]

    def launch_check(self, checks: StreamChecks, group: CheckGroup, index: int) -> None:
        """The pipeline's hook: every byte of `group` (checks' device_groups()[index]) was
        copied; enqueue its checks."""
        raw = self.run(group.data_begin, group.data_end - group.data_begin)
        assert raw is not None, "a check group lies in one segment (verify.CheckGroup)"
        checks.launch_check(index, raw)

    def run(self, position: int, size: int) -> torch.Tensor | None:
        """Arena bytes of data-section bytes [position, position + size) if one segment holds
        them all (one contiguous run), else None."""
        index = bisect.bisect_right(self.segment_begins, position) - 1
        if index < 0:
            return None
        _, segment_end, shift = self.layout.segments[index]
        if position + size > segment_end:
            return None
        return self.arena[position + shift : position + shift + size]

    def elements(self, index: int, first: int, stop: int) -> torch.Tensor:
        """Elements [first, stop) of entries[index] in the arena, 1-D, wire dtype."""
        entry = self.entries[index]
        itemsize = entry.dtype.itemsize
        start = self.layout.offsets[index]
        flat = self.arena[start + first * itemsize : start + stop * itemsize]
        return flat.view(entry.dtype)

    def tensor(self, index: int) -> torch.Tensor:
        entry = self.entries[index]
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype, device=self.arena.device)
        return self.elements(index, 0, entry.nbytes // entry.dtype.itemsize).view(entry.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every entry as a view of the arena, by name: `tensor(i)` for all of them, one
        as_strided each over one view of the arena per dtype (a third of the cost of three
        view ops per tensor: ~0.3 ms instead of ~0.9 ms for 291 tensors, paid by every update
        whose views are not remembered, e.g. one staged in place)."""
        arena, offsets = self.arena, self.layout.offsets
        base = arena.storage_offset()  # as_strided's offset counts from the storage's start
        flats: dict[torch.dtype, torch.Tensor] = {}
        views = {}
        for index, entry in enumerate(self.entries):
            dtype, itemsize = entry.dtype, entry.dtype.itemsize
            if entry.nbytes == 0 or base % itemsize:
                views[entry.name] = self.tensor(index)
                continue
            flat = flats.get(dtype)
            if flat is None:
                flat = flats[dtype] = arena[: len(arena) - len(arena) % itemsize].view(dtype)
            strides = [1] * len(entry.shape)
            for axis in range(len(entry.shape) - 2, -1, -1):
                strides[axis] = strides[axis + 1] * entry.shape[axis + 1]
            start = (base + offsets[index]) // itemsize
            views[entry.name] = flat.as_strided(entry.shape, strides, start)
        return views


class CheckCursor:
    """Checks the elements lying wholly inside data-section range [low, high) as bytes arrive."""

    def __init__(self, data: FileData, checks: StreamChecks, low: int, high: int) -> None:
        self._data = data
        self._checks = checks
        self._high = high
        self._index = bisect.bisect_right(data.entry_ends, low)  # first entry ending after low
        self._next_element = self._first_element(low)

    def _first_element(self, low: int) -> int:
        if self._index >= len(self._data.entries):
            return 0
        entry = self._data.entries[self._index]
        itemsize = entry.dtype.itemsize
        return max(
            0, -(-(low - entry.begin) // itemsize)
        )  # ceil: an element cut at low is not ours

    def advance(self, arrived: int) -> None:
        """Check every element of the range whose last byte is below data offset `arrived`."""
        limit = min(arrived, self._high)
        entries = self._data.entries
        while self._index < len(entries):
            entry = entries[self._index]
            if entry.begin >= self._high:
                return
            itemsize = entry.dtype.itemsize
            stop = (min(limit, entry.end) - entry.begin) // itemsize
            if stop > self._next_element:
                values = self._data.elements(self._index, self._next_element, stop)
                self._checks.check_elements(entry, values)
                self._next_element = stop
            if limit < entry.end:
                return
            self._index += 1
            self._next_element = 0


class DeviceChecks:
    """The cursor of a lane into a device arena: the pipeline checks whole tensors instead."""

    def advance(self, arrived: int) -> None:
        return None


def check_byte_tensor(data: torch.Tensor) -> None:
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise InvalidArgument(
            f"tensor bytes must be a 1-D contiguous uint8 tensor, got {data.dtype} of shape "
            f"{list(data.shape)}"
        )
