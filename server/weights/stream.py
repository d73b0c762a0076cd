"""Receive a safetensors file as ordered chunks and route its bytes into one staging arena.

The 8-byte length and the JSON header are buffered and parsed once; then every data byte is
copied exactly once, from the received chunk straight into a host arena sized for the whole data
section (no whole-file blob, no per-tensor blobs, no safetensors.load). Tensors are views into the
arena in their wire dtype and shape. The arena is a reusable StagingArena when the caller leases
one (the server does: see arena.py for why and for the memory bound), else a fresh buffer.

The arena mirrors the data section byte for byte, so a chunk lands with one memcpy, except where a
tensor would start at an offset that is not a multiple of its itemsize (safetensors does not
require alignment, and torch cannot view misaligned bytes as wider elements). From such a tensor
on, the arena is shifted by a few bytes; each run of constant shift is a "segment", and a chunk is
copied once per segment it touches.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from rollserve.client.errors import InvalidArgument
from rollserve.server.weights.arena import StagingArena
from rollserve.server.weights.checksum import crc32 as crc32_of
from rollserve.server.weights.header import PREFIX_BYTES, StreamEntry, parse_header

__all__ = ["ArenaLayout", "SafetensorsStager", "StagedFile", "StreamChecks", "plan_arena"]


class StreamChecks(Protocol):
    """Verification hooks; each raises InvalidArgument to stop the stream."""

    def check_header(self, entries: Sequence[StreamEntry]) -> None:
        """Called once the header is parsed, before the arena is allocated."""

    def check_elements(self, entry: StreamEntry, values: torch.Tensor) -> None:
        """Called on each run of a tensor's elements (1-D, wire dtype) as soon as they arrived.

        The runs of one tensor come in order and cover each element exactly once; a run is the
        part of one chunk that completed elements, so its bytes are still in the CPU cache.
        """


@dataclass(frozen=True)
class ArenaLayout:
    """Where each tensor lives in the arena; segments are (data_begin, data_end, shift) runs."""

    offsets: tuple[int, ...]  # arena byte offset of each entry, in data order
    segments: tuple[tuple[int, int, int], ...]
    arena_bytes: int


def plan_arena(entries: Sequence[StreamEntry], data_bytes: int) -> ArenaLayout:
    """Give every tensor an itemsize-aligned place; keep file offsets wherever they are aligned."""
    offsets: list[int] = []
    segments: list[tuple[int, int, int]] = []
    shift = 0
    for entry in entries:
        itemsize = entry.dtype.itemsize
        if entry.nbytes and (entry.begin + shift) % itemsize:
            shift += itemsize - (entry.begin + shift) % itemsize
        offsets.append(entry.begin + shift)
        if not entry.nbytes:
            continue
        if segments and segments[-1][2] == shift:
            segments[-1] = (segments[-1][0], entry.end, shift)
        else:
            segments.append((entry.begin, entry.end, shift))
    return ArenaLayout(tuple(offsets), tuple(segments), data_bytes + shift)


@dataclass(frozen=True)
class StagedFile:
    """A completely received and verified file: tensors are views into one host arena."""

    entries: tuple[StreamEntry, ...]
    tensors: Mapping[str, torch.Tensor]
    total_bytes: int


class SafetensorsStager:
    """Takes the file's chunks in order; `finish` returns the staged tensors once all arrived.

    Any error is final: a stager that raised is dropped, never fed again.
    """

    def __init__(
        self,
        total_bytes: int,
        checks: StreamChecks,
        *,
        max_header_bytes: int,
        sha256_hex: str | None = None,
        arena: StagingArena | None = None,
    ) -> None:
        # arena: a leased, reusable buffer (warm memory); None allocates a fresh one.
        self._reusable_arena = arena
        self._total_bytes = total_bytes
        self._checks = checks
        self._max_header_bytes = max_header_bytes
        self._sha256_hex = sha256_hex
        self._digest = hashlib.sha256() if sha256_hex else None
        self._received = 0
        self._head = bytearray()  # the length prefix and JSON header, until parsed
        self._header_bytes: int | None = None
        self._entries: tuple[StreamEntry, ...] = ()
        self._layout: ArenaLayout | None = None
        self._arena: torch.Tensor | None = None
        self._arena_view: memoryview | None = None
        self._segment_begins: list[int] = []
        # entries[:_checked] passed check_elements completely; so did the first _checked_elements
        # elements of entries[_checked].
        self._checked = 0
        self._checked_elements = 0

    @property
    def received_bytes(self) -> int:
        return self._received

    def feed(self, offset: int, data: bytes | memoryview, crc32: int | None = None) -> None:
        """Take the next chunk; offset must equal the bytes received so far."""
        view = memoryview(data).cast("B")
        size = len(view)
        if offset != self._received:
            raise InvalidArgument(
                f"chunk at offset {offset}, expected {self._received}: chunks must arrive in "
                "order, each exactly once"
            )
        if size == 0:
            raise InvalidArgument(f"empty chunk at offset {offset}")
        if offset + size > self._total_bytes:
            raise InvalidArgument(
                f"chunk at offset {offset} with {size} bytes runs past total_bytes "
                f"{self._total_bytes}"
            )
        if crc32 is not None and crc32_of(view) != crc32:
            raise InvalidArgument(f"crc32 mismatch in the chunk at offset {offset}")
        if self._digest is not None:
            self._digest.update(view)
        self._received += size
        while view and self._arena is None:  # still in the length prefix or the JSON header
            take = self._head_target() - len(self._head)
            self._head += view[:take]
            view = view[take:]
            self._advance_head()
        if view:
            self._route(offset + size - len(view) - self._data_start(), view)

    def finish(self) -> StagedFile:
        """Check that the stream is complete and its SHA-256 matches; return the staged tensors."""
        if self._received != self._total_bytes:
            raise InvalidArgument(
                f"stream ended after {self._received} of {self._total_bytes} bytes"
            )
        if self._digest is not None and self._digest.hexdigest() != self._sha256_hex:
            raise InvalidArgument("sha256 of the received file does not match header.sha256")
        self._check_arrived(self._total_bytes - self._data_start())
        tensors = {entry.name: self._tensor(i) for i, entry in enumerate(self._entries)}
        return StagedFile(self._entries, tensors, self._total_bytes)

    def _head_target(self) -> int:
        return PREFIX_BYTES if self._header_bytes is None else PREFIX_BYTES + self._header_bytes

    def _data_start(self) -> int:
        assert self._header_bytes is not None
        return PREFIX_BYTES + self._header_bytes

    def _advance_head(self) -> None:
        if self._header_bytes is None and len(self._head) == PREFIX_BYTES:
            header_bytes = int.from_bytes(self._head, "little")
            if header_bytes > self._max_header_bytes:
                raise InvalidArgument(
                    f"safetensors header of {header_bytes} bytes is over the limit of "
                    f"{self._max_header_bytes}"
                )
            if PREFIX_BYTES + header_bytes > self._total_bytes:
                raise InvalidArgument(
                    f"safetensors header of {header_bytes} bytes does not fit in total_bytes "
                    f"{self._total_bytes}"
                )
            self._header_bytes = header_bytes
        if self._header_bytes is not None and len(self._head) == self._head_target():
            self._start_data()

    def _start_data(self) -> None:
        data_bytes = self._total_bytes - self._data_start()
        self._entries = parse_header(bytes(self._head[PREFIX_BYTES:]), data_bytes)
        self._head = bytearray()
        # Verify names, shapes and dtypes against the model before allocating anything big.
        self._checks.check_header(self._entries)
        self._layout = plan_arena(self._entries, data_bytes)
        self._segment_begins = [begin for begin, _, _ in self._layout.segments]
        if self._reusable_arena is not None:
            self._arena = self._reusable_arena.take(self._layout.arena_bytes)
        else:
            self._arena = torch.empty(self._layout.arena_bytes, dtype=torch.uint8)
        self._arena_view = memoryview(self._arena.numpy())

    def _route(self, position: int, view: memoryview) -> None:
        """Copy data-section bytes [position, position + len(view)) into the arena."""
        assert self._layout is not None and self._arena_view is not None
        segments = self._layout.segments
        index = bisect.bisect_right(self._segment_begins, position) - 1
        end = position + len(view)
        while view:
            _, segment_end, shift = segments[index]
            take = min(len(view), segment_end - position)
            self._arena_view[position + shift : position + shift + take] = view[:take]
            view = view[take:]
            position += take
            index += 1
        self._check_arrived(end)

    def _check_arrived(self, data_received: int) -> None:
        """Check every element whose last byte is among the first data_received bytes.

        Per chunk rather than per tensor: the bytes were just copied and are still in the cache,
        and a large tensor no longer stalls the stream with one long pass when it completes.
        """
        while self._checked < len(self._entries):
            entry = self._entries[self._checked]
            itemsize = entry.dtype.itemsize
            numel = entry.nbytes // itemsize
            arrived = min(numel, max(0, data_received - entry.begin) // itemsize)
            if arrived > self._checked_elements:
                values = self._flat(self._checked)[self._checked_elements : arrived]
                self._checks.check_elements(entry, values)
                self._checked_elements = arrived
            if arrived < numel:
                return
            self._checked += 1
            self._checked_elements = 0

    def _flat(self, index: int) -> torch.Tensor:
        """The elements of entries[index] in the arena, 1-D (empty for an empty tensor)."""
        assert self._layout is not None and self._arena is not None
        entry = self._entries[index]
        if entry.nbytes == 0:
            return torch.empty(0, dtype=entry.dtype)
        start = self._layout.offsets[index]
        return self._arena[start : start + entry.nbytes].view(entry.dtype)

    def _tensor(self, index: int) -> torch.Tensor:
        return self._flat(index).view(self._entries[index].shape)
