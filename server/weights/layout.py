"""Where a file's tensors go in the staging arena, and the verified head an arena keeps.

`plan_arena` gives every tensor an itemsize-aligned place in the arena (stream.py explains the
segments); `VerifiedHead` is what a head that passed its checks leaves behind for the next
update of the same model (stream.py reuses it when the next head is byte for byte the same).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .header import StreamEntry

__all__ = ["ArenaLayout", "VerifiedHead", "plan_arena"]


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
class VerifiedHead:
    """A head that passed its checks, kept by the arena (one per model) for the next update.

    A trainer sends the same tensors at every step, so the head's bytes repeat; an update whose
    head is byte for byte the last one's, with an equal `key` (StreamChecks.head_key), reuses
    the parsed entries, the arena layout and what the checks derived (the plan, the device check
    groups) instead of parsing ~300 entries and planning them again. `views` are the staged
    tensors of the last update, kept for the arena buffer they view (`buffer`)."""

    raw: bytes  # the JSON header, without the length prefix
    data_bytes: int
    key: Hashable
    entries: tuple[StreamEntry, ...]
    layout: ArenaLayout
    verified: object
    views: dict[tuple[int, int], Mapping[str, torch.Tensor]] = field(default_factory=dict)

    def matches(self, raw: bytes, data_bytes: int, key: Hashable) -> bool:
        return data_bytes == self.data_bytes and key == self.key and raw == self.raw
