"""Weight updates: safetensors stream staging, verification, atomic swap, LoRA merge.

Flow: `WeightUpdates.update(requests)` (update.py, the state machine; gRPC handler thread) reads
the header, picks the data plane (planes.py), checks target and version, stages the file into
the target's arena and verifies it (an `UpdateStager` returns a `StagedUpdate`), then hands
`staged.apply(model)` to the swap callable, which runs it on the engine thread between batches.

Modules: update (the state machine), planes (which plane carries the bytes), header (safetensors
JSON), options (WeightsHeader fields), stream (bytes into the staging arena), arena (each model's
reusable staging buffer), spec (the model's names, shapes, dtypes), verify (names, shapes, dtype
rules, values), lora (PEFT adapters), staging (UpdateStager, StagedUpdate, the stream's
messages). Data planes, each feeding the same UpdateStager: chunks on the stream
(staging.iter_chunks), shared_memory (a client's sealed memfd on the same host), parallel (one
file over several streams), distributed (a torch.distributed broadcast after InitWeightsGroup).
"""

from __future__ import annotations

from .arena import StagingArena, staging_arena
from .header import DEFAULT_MAX_HEADER_BYTES
from .lora import LoraState
from .planes import Planes
from .staging import (
    AppliedUpdate,
    StagedUpdate,
    UpdateStager,
    iter_chunks,
    read_header,
)
from .update import Swap, WeightUpdates

__all__ = [
    "DEFAULT_MAX_HEADER_BYTES",
    "AppliedUpdate",
    "LoraState",
    "Planes",
    "StagedUpdate",
    "StagingArena",
    "Swap",
    "UpdateStager",
    "WeightUpdates",
    "iter_chunks",
    "read_header",
    "staging_arena",
]
