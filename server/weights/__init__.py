"""Weight updates: safetensors stream staging, verification, atomic swap, LoRA merge.

Flow: `stage_update(requests, model, lora_state)` (gRPC handler thread; reads only the model's
metadata) returns a verified `StagedUpdate`; the engine thread calls `staged.apply(model)` between
batches. Modules: header (safetensors JSON), options (WeightsHeader fields), stream (bytes into the
staging arena), arena (each model's reusable staging buffer), verify (names, shapes, dtype rules,
values), lora (PEFT adapters), staging (the two entry points).
"""

from __future__ import annotations

from rollserve.server.weights.arena import StagingArena, staging_arena
from rollserve.server.weights.header import DEFAULT_MAX_HEADER_BYTES
from rollserve.server.weights.lora import LoraState
from rollserve.server.weights.staging import (
    AppliedUpdate,
    StagedUpdate,
    UpdateStager,
    read_header,
    stage_chunks,
    stage_update,
)

__all__ = [
    "DEFAULT_MAX_HEADER_BYTES",
    "AppliedUpdate",
    "LoraState",
    "StagedUpdate",
    "StagingArena",
    "UpdateStager",
    "read_header",
    "stage_chunks",
    "stage_update",
    "staging_arena",
]
