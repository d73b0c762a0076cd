"""What an update is checked against: the target model's state-dict names, shapes and dtypes.

Read once per update from the live model (metadata only, never the values); verify.py and lora.py
plan the file's tensors onto it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = ["ModelSpec", "TargetTensor", "model_spec"]


@dataclass(frozen=True)
class TargetTensor:
    """A parameter or buffer of the model, by its state-dict name."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ModelSpec:
    """The model's state-dict metadata; tied names (one tensor under several names) share a root."""

    tensors: Mapping[str, TargetTensor]
    root: Mapping[str, str]  # name -> first name of its tied group (itself when untied)


def model_spec(model: torch.nn.Module) -> ModelSpec:
    """Read names, shapes and dtypes of the model's state dict (persistent buffers included)."""
    tensors: dict[str, TargetTensor] = {}
    root: dict[str, str] = {}
    first_by_storage: dict[tuple[object, ...], str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        tensors[name] = TargetTensor(name, tuple(tensor.shape), tensor.dtype)
        root[name] = name
        if tensor.numel() and tensor.device.type != "meta":
            key = (tensor.device, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
            root[name] = first_by_storage.setdefault(key, name)
    return ModelSpec(MappingProxyType(tensors), MappingProxyType(root))
