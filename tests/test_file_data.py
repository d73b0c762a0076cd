"""FileData (server/weights/file_data.py) on the CPU: a host arena takes routed bytes through
its numpy view; a device arena's FileData is built without reading its memory on the host (the
stager sets its pipeline only once the FileData exists: a CUDA arena failed there on an H200,
2026-11-27). A meta tensor stands in for device memory: it has no host bytes either."""

from __future__ import annotations

import numpy as np
import torch
from rollserve.server.weights.file_data import FileData
from rollserve.server.weights.header import StreamEntry
from rollserve.server.weights.layout import plan_arena

ENTRY = StreamEntry(name="w", dtype_name="F32", shape=(4,), begin=0, end=16)
LAYOUT = plan_arena([ENTRY], 16)


def test_a_host_arena_takes_routed_bytes() -> None:
    data = FileData((ENTRY,), 24, torch.zeros(LAYOUT.arena_bytes, dtype=torch.uint8), LAYOUT)
    data.route(0, np.arange(16, dtype=np.uint8))
    assert data.arena.tolist() == list(range(16)) and not data.on_device


def test_an_arena_without_host_bytes_is_never_read_on_the_host() -> None:
    arena = torch.empty(LAYOUT.arena_bytes, dtype=torch.uint8, device="meta")
    data = FileData((ENTRY,), 24, arena, LAYOUT)
    assert data.arena_np is None and data.arena is arena
