"""Which generation path a model runs on, and its one engine per loaded model.

Path selection (ROLLSERVE_GENERATION, or the caller's explicit choice):
  auto      - the engine for supported models on CUDA, where captured graphs pay off; the
              Hugging Face path on the CPU (tuned for it) and for every other model
  rollserve - the engine wherever the model is supported (also on the CPU)
  hf        - always the Hugging Face path
"""

from __future__ import annotations

import logging
import os
import weakref

import torch

from .families import read_family, unsupported_reason
from .runner import Engine

__all__ = ["GENERATION_MODES", "engine_for", "engine_path", "generation_mode"]

GENERATION_MODES = ("auto", "rollserve", "hf")
_ENV = "ROLLSERVE_GENERATION"
_KV_ENV = "ROLLSERVE_KV_CACHE_TOKENS"

_log = logging.getLogger("rollserve.generation")
# Model -> its Engine, or None when the engine cannot run it; weak, so models can be freed.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generation_mode(mode: str | None = None) -> str:
    """The requested mode: `mode`, else $ROLLSERVE_GENERATION, else auto."""
    chosen = (mode or os.environ.get(_ENV) or "auto").strip().lower()
    if chosen not in GENERATION_MODES:
        raise ValueError(f"{_ENV} must be one of {GENERATION_MODES}, got {chosen!r}")
    return chosen


def _device(model: torch.nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def engine_path(model: torch.nn.Module, mode: str | None = None) -> str:
    """'rollserve' when generate() runs `model` on the engine, else 'hf'."""
    chosen = generation_mode(mode)
    if chosen == "hf" or unsupported_reason(model) is not None:
        return "hf"
    if chosen == "auto" and _device(model).type != "cuda":
        return "hf"
    return "rollserve"


def engine_for(model: torch.nn.Module, mode: str | None = None) -> Engine | None:
    """The model's engine when its path is 'rollserve' (built on first use), else None."""
    path = engine_path(model, mode)
    if path == "hf":
        if model not in _ENGINES:
            reason = (
                unsupported_reason(model) or f"mode {generation_mode(mode)} on {_device(model)}"
            )
            _log.info("generation path of %s: hf (%s)", type(model).__name__, reason)
            _ENGINES[model] = None
        return None
    engine = _ENGINES.get(model)
    if engine is None or engine.device != _device(model):
        family = read_family(model)
        assert family is not None  # engine_path checked it
        tokens = os.environ.get(_KV_ENV)
        engine = Engine(model, family, kv_cache_tokens=int(tokens) if tokens else None)
        _ENGINES[model] = engine
        _log.info(
            "generation path of %s: rollserve (KV cache %d tokens, CUDA graphs %s)",
            type(model).__name__, engine.capacity_tokens, engine.use_graphs,
        )  # fmt: skip
    return engine
