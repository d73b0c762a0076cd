"""What an update is checked against: the target model's state-dict names, shapes and dtypes.

Read once per update from the live model (metadata only, never the values); verify.py and lora.py
plan the file's tensors onto it.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = ["ModelSpec", "TargetTensor", "live_tensors", "model_spec"]


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


def live_tensors(model: torch.nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor] | None:
    """The tensors `model.state_dict(keep_vars=True)` holds under `names` (a name it lacks is
    left out), read from their modules now; None when the model's state dict is not plainly its
    modules' parameters and persistent buffers (a state-dict hook, an overridden `state_dict` or
    `_save_to_state_dict` somewhere: call state_dict then).

    An update's apply resolves its targets so. The whole state dict walks every module and
    builds every name, per update (0.9-1.3 ms for 291 tensors on a 2-core CPU); here the
    modules that hold `names` are found once and remembered with the chain of modules above
    them, which is checked link by link at every call (a module replaced or deleted since is
    found as it is now), and each tensor is read from its module's dict fresh (a parameter
    replaced since is the new one)."""
    if not _plain_state_dict(model):
        return None
    names = tuple(names)
    known = _LOOKUPS.get(model)
    if known is None or known.names != names or not known.still_linked():
        known = _LOOKUPS[model] = _Lookup.of(model, names)
    found: dict[str, torch.Tensor] = {}
    for name, module, attr in known.holders:
        tensor = module._parameters.get(attr)
        if tensor is None and attr not in module._non_persistent_buffers_set:
            tensor = module._buffers.get(attr)
        if tensor is not None:
            found[name] = tensor
    return found


@dataclass(frozen=True)
class _Lookup:
    """Where a model's `names` live: (name, module, attribute) for each name whose module
    exists, and every (parent, key, child) link on the way to those modules."""

    names: tuple[str, ...]
    holders: tuple[tuple[str, torch.nn.Module, str], ...]
    links: tuple[tuple[torch.nn.Module, str, torch.nn.Module], ...]

    @classmethod
    def of(cls, model: torch.nn.Module, names: tuple[str, ...]) -> _Lookup:
        modules: dict[str, torch.nn.Module | None] = {"": model}
        links: dict[tuple[int, str], tuple[torch.nn.Module, str, torch.nn.Module]] = {}
        holders = []
        for name in names:
            prefix, _, attr = name.rpartition(".")
            if prefix not in modules:
                module: torch.nn.Module | None = model
                for part in prefix.split("."):
                    child = module._modules.get(part)
                    if child is None:  # no such module: the name is left out
                        module = None
                        break
                    links[(id(module), part)] = (module, part, child)
                    module = child
                modules[prefix] = module
            holder = modules[prefix]
            if holder is not None:
                holders.append((name, holder, attr))
        return cls(names, tuple(holders), tuple(links.values()))

    def still_linked(self) -> bool:
        return all(parent._modules.get(key) is child for parent, key, child in self.links)


_LOOKUPS: weakref.WeakKeyDictionary[torch.nn.Module, _Lookup] = weakref.WeakKeyDictionary()
_PLAIN: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def _plain_state_dict(model: torch.nn.Module) -> bool:
    """Whether no module of `model` changes what state_dict reports (hooks, an overridden
    `state_dict` or `_save_to_state_dict`); checked once per model (a server never adds hooks
    later)."""
    plain = _PLAIN.get(model)
    if plain is None:
        plain = _PLAIN[model] = all(
            not module._state_dict_hooks
            and not module._state_dict_pre_hooks
            and type(module)._save_to_state_dict is torch.nn.Module._save_to_state_dict
            and type(module).state_dict is torch.nn.Module.state_dict
            for module in model.modules()
        )
    return plain
