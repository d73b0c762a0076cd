"""Which generation path a model runs on, and its one engine per loaded model.

Paths (GenerationSettings.path: the server's --generation-path, or a caller's explicit choice):
  auto      - the engine for supported models on CUDA, where captured graphs pay off; the
              Hugging Face path on the CPU (tuned for it) and for every other model
  rollserve - the engine wherever the model is supported (also on the CPU)
  hf        - always the Hugging Face path

The settings come from the server's configuration (GenerationSettings.from_config) and from
nowhere else: no environment variable competes with the flags. A server's maker records them
for each model it hosts (`adopt_settings`); a call that passes no settings gets the model's
recorded ones (else the defaults), so generation and scoring take the same path.

Scoring follows the same rule (`scoring_path`): the engine's forward on the decoder body of any
model whose body the engine runs (the actor and reference, and a critic or reward model built
on a supported body), wherever generation would take the engine.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from ..config import ServerConfig
from ..config.values import GENERATION_PATHS
from .compiling import compiles_by_default
from .families import body_unsupported_reason, read_body, read_family, unsupported_reason
from .fused import fuses_by_default
from .model import Forward
from .rotary import RopeTable
from .runner import Engine

__all__ = [
    "GENERATION_MODES",
    "GenerationSettings",
    "adopt_settings",
    "built_engine",
    "engine_for",
    "engine_path",
    "generation_mode",
    "scoring_forward",
    "scoring_path",
    "staging_reserve_bytes",
]

GENERATION_MODES = GENERATION_PATHS  # the flag's choices, one table

_log = logging.getLogger("rollserve.generation")
# Model -> (its Engine or None when the engine does not run it, the settings it was built
# with); weak, so models can be freed.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Model -> the GenerationSettings of the server that hosts it (adopt_settings).
_ADOPTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Model -> the Forward over its decoder body that scoring uses when it has no engine.
_SCORING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


def adopt_settings(model: torch.nn.Module, settings: GenerationSettings) -> None:
    """Record the settings of the server that hosts `model`: calls for it that pass none
    (scoring's, in the maker's steps) use them."""
    _ADOPTED[model] = settings


def _settings(
    settings: GenerationSettings | str | None, model: torch.nn.Module | None = None
) -> GenerationSettings:
    """A path name (tests, benchmarks) is shorthand for the default settings on that path;
    None: the settings adopted for `model`, else the defaults."""
    if isinstance(settings, GenerationSettings):
        return settings
    if settings is None and model is not None and model in _ADOPTED:
        return _ADOPTED[model]
    return GenerationSettings(path=generation_mode(settings))


def _device(model: torch.nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def engine_path(model: torch.nn.Module, settings: GenerationSettings | str | None = None) -> str:
    """'rollserve' when generate() runs `model` on the engine, else 'hf'. Pure: touches no
    device memory (Health calls it)."""
    return _path(model, settings, supported=unsupported_reason(model) is None)


def scoring_path(model: torch.nn.Module, settings: GenerationSettings | str | None = None) -> str:
    """'rollserve' when scoring runs `model`'s decoder body on the engine's forward, else 'hf':
    the rule of engine_path, for any model whose body the engine runs (critics and reward
    models included)."""
    return _path(model, settings, supported=body_unsupported_reason(model) is None)


def _path(
    model: torch.nn.Module, settings: GenerationSettings | str | None, *, supported: bool
) -> str:
    """The one rule of both paths: 'hf' when asked or unsupported, and under 'auto' off CUDA."""
    chosen = _settings(settings, model).path
    if chosen == "hf" or not supported:
        return "hf"
    if chosen == "auto" and _device(model).type != "cuda":
        return "hf"
    return "rollserve"


def scoring_forward(
    model: torch.nn.Module, settings: GenerationSettings | str | None = None
) -> Forward | None:
    """The engine's forward over `model`'s decoder body when scoring_path is 'rollserve', else
    None. A model with an engine shares its forward (and rotary table); another gets one of
    its own, kept while the model lives (no KV cache: scoring writes none)."""
    if scoring_path(model, settings) == "hf":
        return None
    engine = built_engine(model)
    if engine is not None:
        return engine.forward
    weight = model.get_input_embeddings().weight
    forward = _SCORING.get(model)
    if (
        forward is None
        or forward.rope.cos.device != weight.device
        or (forward.rope.cos.dtype != weight.dtype)
    ):
        # A causal LM of the engine's list is read with its lm_head, any other with its body.
        family = read_family(model) or read_body(model)
        assert family is not None  # scoring_path checked it
        rope = RopeTable(family.rotary, family.max_positions, weight.dtype)
        # Compiled as an engine's (on CUDA): the parameters are arguments, so the compiled code
        # of the actor's forward serves a reference of the same shapes too.
        forward = Forward(
            family,
            rope,
            compiled=compiles_by_default(weight.device),
            fused=fuses_by_default(weight.device),
        )
        _SCORING[model] = forward
        _log.info("scoring path of %s: rollserve", type(model).__name__)
    return forward


def staging_reserve_bytes(model: torch.nn.Module) -> int:
    """Device memory the KV budget of `model`'s engine leaves for weight updates: one staging
    copy (weights/arena.py) of the full state dict, in its dtype, of `model` and of every
    model a server hosts with it on its device (they adopted the same settings object:
    each of a server's models is a target of UpdateWeights). Only a budget on CUDA subtracts
    it (kv_cache.default_capacity_tokens)."""
    device = _first_device(model)
    settings = _ADOPTED.get(model)
    hosted = [model]
    if settings is not None:
        hosted += [
            other
            for other, adopted in list(_ADOPTED.items())
            if adopted is settings and other is not model and _first_device(other) == device
        ]
    return sum(_state_bytes(each) for each in hosted)


def _first_device(model: torch.nn.Module) -> torch.device | None:
    # Any model a server hosts (a critic or reward model too), not only causal LMs.
    return next((t.device for t in model.parameters()), None)


def _state_bytes(model: torch.nn.Module) -> int:
    # Every name a full update may carry (tied weights under both names): a client streams a
    # module as its state dict.
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def built_engine(model: torch.nn.Module) -> Engine | None:
    """The engine already built for `model`, if any (never builds one)."""
    entry = _ENGINES.get(model)
    return None if entry is None else entry[0]


def engine_for(
    model: torch.nn.Module, settings: GenerationSettings | str | None = None
) -> Engine | None:
    """The model's engine when its path is 'rollserve' (built on first use, and again when the
    KV budget asked for changed), else None."""
    settings = _settings(settings, model)
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
            staging_reserve_bytes=staging_reserve_bytes(model),
        )
        _ENGINES[model] = (engine, budget)
        _log.info(
            "generation path of %s: rollserve (KV cache %d tokens, CUDA graphs %s, fused "
            "projections %d)",
            type(model).__name__, engine.capacity_tokens, engine.use_graphs,
            engine.forward.fused_projections,
        )  # fmt: skip
        if engine.capacity_tokens == 0:
            _log.warning(
                "the KV cache budget is 0 tokens (gpu_memory_utilization %.2f is below the "
                "device memory already in use): generation takes the Hugging Face path",
                settings.gpu_memory_utilization,
            )
    return engine
