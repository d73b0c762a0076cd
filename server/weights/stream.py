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

    def check_tensor(self, entry: StreamEntry, tensor: torch.Tensor) -> None:
        """Called as soon as a tensor's last byte has arrived (while its bytes are still cached)."""


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
        self._checked = 0  # entries[:_checked] were complete and passed check_tensor

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
        self._check_complete(self._total_bytes - self._data_start())
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
        self._check_complete(end)

    def _check_complete(self, data_received: int) -> None:
        while (
            self._checked < len(self._entries) and self._entries[self._checked].end <= data_received
        ):
            self._checks.check_tensor(self._entries[self._checked], self._tensor(self._checked))
            self._checked += 1

    def _tensor(self, index: int) -> torch.Tensor:
        assert self._layout is not None and self._arena is not None
        entry = self._entries[index]
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        start = self._layout.offsets[index]
        return self._arena[start : start + entry.nbytes].view(entry.dtype).view(entry.shape)
