"""rollserve's generation engine for Llama-family models: own forward over the HF module's
parameters, static KV cache, on-device sampling, CUDA graphs of the decode step."""

from .families import SUPPORTED_ARCHITECTURES, read_family, unsupported_reason
from .registry import (
    GENERATION_MODES,
    GenerationSettings,
    built_engine,
    engine_for,
    engine_path,
    generation_mode,
)
from .runner import Engine, EngineResult

__all__ = [
    "GENERATION_MODES",
    "SUPPORTED_ARCHITECTURES",
    "Engine",
    "EngineResult",
    "GenerationSettings",
    "built_engine",
    "engine_for",
    "engine_path",
    "generation_mode",
    "read_family",
    "unsupported_reason",
]
