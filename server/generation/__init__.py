"""rollserve's generation engine for Llama-family models: own forward over the HF module's
parameters, static KV cache, on-device sampling, CUDA graphs of the decode step."""

from .families import (
    SUPPORTED_ARCHITECTURES,
    body_unsupported_reason,
    read_body,
    read_family,
    unsupported_reason,
)
from .kv_cache import SCORING_CHUNK_BYTES
from .model import Forward
from .registry import (
    GENERATION_MODES,
    GenerationSettings,
    adopt_settings,
    built_engine,
    engine_for,
    engine_path,
    generation_mode,
    scoring_forward,
    scoring_path,
)
from .runner import Engine, EngineMemory, EngineResult

__all__ = [
    "GENERATION_MODES",
    "SCORING_CHUNK_BYTES",
    "SUPPORTED_ARCHITECTURES",
    "Engine",
    "EngineMemory",
    "EngineResult",
    "Forward",
    "GenerationSettings",
    "adopt_settings",
    "body_unsupported_reason",
    "built_engine",
    "engine_for",
    "engine_path",
    "generation_mode",
    "read_body",
    "read_family",
    "scoring_forward",
    "scoring_path",
    "unsupported_reason",
]
