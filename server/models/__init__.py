"""The models one server hosts: loading (`loading.py`), the built-in tiny default
(`default_model.py`) and a CPU model's weights in one buffer (`memory.py`)."""

from .loading import LoadedModel, ModelLoadError, ModelSet, check_model_dirs, load_models

__all__ = ["LoadedModel", "ModelLoadError", "ModelSet", "check_model_dirs", "load_models"]
