"""Weight updates: safetensors stream staging, verification, atomic swap, LoRA merge.

Flow: `stage_update(requests, model, lora_state)` (gRPC handler thread; reads only the model's
metadata) returns a verified `StagedUpdate`; the engine thread calls `staged.apply(model)` between
batches. Modules: header (safetensors JSON), options (WeightsHeader fields), stream (bytes into the
staging arena), arena (each model's reusable staging buffer), verify (names, shapes, dtype rules,
values), lora (PEFT adapters), staging (the two entry points). Data planes, each feeding the same
UpdateStager: chunks on the stream (staging.iter_chunks), shared_memory (a client's sealed memfd
on the same host), parallel (one file over several streams), distributed (a torch.distributed
broadcast after InitWeightsGroup).
"""

from __future__ import annotations

from .arena import StagingArena, staging_arena
from .header import DEFAULT_MAX_HEADER_BYTES
from .lora import LoraState
from .staging import (
    AppliedUpdate,
    StagedUpdate,
    UpdateStager,
    iter_chunks,
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
    "iter_chunks",
    "read_header",
    "stage_chunks",
    "stage_update",
    "staging_arena",
]
