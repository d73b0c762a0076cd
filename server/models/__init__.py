"""Loading the actor, reference, critic and reward model (and the built-in tiny default)."""

from .loading import (
    ROLES,
    LoadedModel,
    ModelLoadError,
    ModelSet,
    check_model_dirs,
    load_models,
    resolve_device,
    resolve_dtype,
)

__all__ = [
    "ROLES",
    "ModelLoadError",
    "LoadedModel",
    "ModelSet",
    "check_model_dirs",
    "load_models",
    "resolve_device",
    "resolve_dtype",
]
