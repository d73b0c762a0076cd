"""Which generation path a model runs on, and its one engine per loaded model.

Paths (GenerationSettings.path: the server's --generation-path, or a caller's explicit choice):
  auto      - the engine for supported models on CUDA, where captured graphs pay off; the
              Hugging Face path on the CPU (tuned for it) and for every other model
  rollserve - the engine wherever the model is supported (also on the CPU)
  hf        - always the Hugging Face path

The settings come from the server's configuration (GenerationSettings.from_config) and from
nowhere else: no environment variable competes with the flags.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from ..config import ServerConfig
from ..config.values import GENERATION_PATHS
from .families import read_family, unsupported_reason
from .runner import Engine

__all__ = [
    "GENERATION_MODES",
    "GenerationSettings",
    "built_engine",
    "engine_for",
    "engine_path",
    "generation_mode",
]

GENERATION_MODES = GENERATION_PATHS  # the flag's choices, one table

_log = logging.getLogger("rollserve.generation")
# Model -> (its Engine or None when the engine does not run it, the settings it was built
# with); weak, so models can be freed.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class GenerationSettings:
    """How a server generates: the path, and the engine's KV cache budget (defaults: the
    server's, ServerConfig)."""

    path: str = ServerConfig.generation_path
    kv_cache_tokens: int = ServerConfig.kv_cache_tokens  # 0: from gpu_memory_utilization
    gpu_memory_utilization: float = ServerConfig.gpu_memory_utilization

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", generation_mode(self.path))

    @classmethod
    def from_config(cls, config: ServerConfig) -> GenerationSettings:
        return cls(
            path=config.generation_path,
            kv_cache_tokens=config.kv_cache_tokens,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )


def generation_mode(mode: str | None = None) -> str:
    """The requested mode, checked: `mode`, else auto."""
    chosen = (mode or "auto").strip().lower()
    if chosen not in GENERATION_MODES:
        raise ValueError(f"generation path must be one of {GENERATION_MODES}, got {chosen!r}")
    return chosen


def _settings(settings: GenerationSettings | str | None) -> GenerationSettings:
    """A path name (tests, benchmarks) is shorthand for the default settings on that path."""
    if isinstance(settings, GenerationSettings):
        return settings
    return GenerationSettings(path=generation_mode(settings))


def _device(model: torch.nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def engine_path(model: torch.nn.Module, settings: GenerationSettings | str | None = None) -> str:
    """'rollserve' when generate() runs `model` on the engine, else 'hf'. Pure: touches no
    device memory (Health calls it)."""
    chosen = _settings(settings).path
    if chosen == "hf" or unsupported_reason(model) is not None:
        return "hf"
    if chosen == "auto" and _device(model).type != "cuda":
        return "hf"
    return "rollserve"


def built_engine(model: torch.nn.Module) -> Engine | None:
    """The engine already built for `model`, if any (never builds one)."""
    entry = _ENGINES.get(model)
    return None if entry is None else entry[0]


def engine_for(
    model: torch.nn.Module, settings: GenerationSettings | str | None = None
) -> Engine | None:
    """The model's engine when its path is 'rollserve' (built on first use, and again when the
    KV budget asked for changed), else None."""
    settings = _settings(settings)
    budget = (settings.kv_cache_tokens, settings.gpu_memory_utilization)
    if engine_path(model, settings) == "hf":
        if model not in _ENGINES:
            reason = unsupported_reason(model) or f"path {settings.path} on {_device(model)}"
            _log.info("generation path of %s: hf (%s)", type(model).__name__, reason)
            _ENGINES[model] = (None, None)
        return None
    engine, built_with = _ENGINES.get(model, (None, None))
    if engine is None or engine.device != _device(model) or built_with != budget:
        family = read_family(model)
        assert family is not None  # engine_path checked it
        engine = Engine(
            model,
            family,
            kv_cache_tokens=settings.kv_cache_tokens,
            gpu_memory_utilization=settings.gpu_memory_utilization,
        )
        _ENGINES[model] = (engine, budget)
        _log.info(
            "generation path of %s: rollserve (KV cache %d tokens, CUDA graphs %s)",
            type(model).__name__, engine.capacity_tokens, engine.use_graphs,
        )  # fmt: skip
        if engine.capacity_tokens == 0:
            _log.warning(
                "the KV cache budget is 0 tokens (gpu_memory_utilization %.2f is below the "
                "device memory already in use): generation takes the Hugging Face path",
                settings.gpu_memory_utilization,
            )
    return engine
