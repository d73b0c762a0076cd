"""Weights that live in one run of memory laid out like the update file's data section.

A trainer that broadcasts its weights every step (WeightsGroup) pays, per broadcast, a fixed
cost in gloo, and a fill copy for every range that crosses a tensor boundary. With the weights
flattened once (`flatten_weights`, the way FSDP keeps flat parameters), the data section of
every later update is one existing run of memory: the broadcasts are plain bucket-sized slices
of it (DistributedSource.contiguous), with no copy on either side. For cuda_ipc the same buffer
is one CUDA IPC handle and one span, which a server on the same GPU checks and applies in place,
and a tied weight's second name is a shadow the export refreshes (`shadows_of`), so a trainer's
tied model stays one span too.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..protocol.errors import InvalidArgument
from .update_file import WeightSpec, safetensors_header

__all__ = [
    "Shadow",
    "data_section_run",
    "flatten_weights",
    "refresh_shadow",
    "shadows_of",
    "tied_shadow",
]


def flatten_weights(weights: Mapping[str, torch.Tensor] | torch.nn.Module) -> None:
    """Move every tensor of `weights` into one buffer on their device, each at its offset in
    the update file's data section (the same order update_weights writes). For a module its
    parameters and buffers themselves move (`.data`), so an optimizer keeps working on them.

    A tied weight (one tensor under several names) lives at its first name's offset; the
    offsets of its other names hold a copy, a *shadow* the buffer remembers (`shadows_of`):
    cuda_ipc's export refreshes it before each update (one device copy of that tensor), so
    the data section stays one run of memory and a server on the same GPU checks and applies
    it in place. Sent any other way, such a state dict updates correctly too, through the
    ranges that follow the tensors.
    """
    state_dict = (
        weights.state_dict(keep_vars=True) if isinstance(weights, torch.nn.Module) else weights
    )
    if not state_dict:
        return
    devices = {tensor.device for tensor in state_dict.values()}
    if len(devices) != 1:
        raise InvalidArgument(
            f"flatten_weights: the tensors are on {len(devices)} devices, not one"
        )
    _, specs = safetensors_header(state_dict)
    data_bytes = specs[-1].end
    flat = torch.empty(data_bytes, dtype=torch.uint8, device=devices.pop())
    # Where each tensor's memory is now (read before anything moves): one tensor under two
    # names, or two views of the same memory, is one key.
    keys = {spec.name: _memory_key(state_dict[spec.name]) for spec in specs}
    first_of: dict[tuple, WeightSpec] = {}
    shadows: dict[str, Shadow] = {}
    with torch.no_grad():
        for spec in specs:
            tensor = state_dict[spec.name]
            if not spec.nbytes:
                continue
            first = first_of.get(keys[spec.name])
            if first is not None:  # a tied name: a shadow of the first one's bytes
                flat[spec.begin : spec.end].copy_(flat[first.begin : first.end])
                shadows[spec.name] = Shadow(spec.begin, first.begin, spec.nbytes)
                if tensor is not state_dict[first.name]:  # another view of that memory
                    tensor.data = (
                        flat[first.begin : first.end].view(tensor.dtype).view(tensor.shape)
                    )
                continue
            first_of[keys[spec.name]] = spec
            place = flat[spec.begin : spec.end].view(tensor.dtype).view(tensor.shape)
            place.copy_(tensor.detach())
            tensor.data = place
    if shadows:
        _remember_shadows(flat.untyped_storage(), shadows)


class Shadow(NamedTuple):
    """A tied name's bytes in a flattened buffer: `nbytes` at byte `begin` of its storage,
    a copy of those at `source` (the tensor's own place, its first name's)."""

    begin: int
    source: int
    nbytes: int


def shadows_of(storage: torch.UntypedStorage) -> Mapping[str, Shadow]:
    """The shadows of the buffer `storage` is (flatten_weights), by tied name; empty for any
    other storage."""
    with _SHADOWS_LOCK:
        known = _SHADOWS.get(storage.data_ptr())
        if known is None:
            return {}
        weak, cdata, shadows = known
        if weak.expired() or storage._cdata != cdata:  # freed; this is other memory
            del _SHADOWS[storage.data_ptr()]
            return {}
        return shadows


def _remember_shadows(storage: torch.UntypedStorage, shadows: dict[str, Shadow]) -> None:
    with _SHADOWS_LOCK:
        for address in [a for a, (weak, _, _) in _SHADOWS.items() if weak.expired()]:
            del _SHADOWS[address]
        _SHADOWS[storage.data_ptr()] = (StorageWeakRef(storage), storage._cdata, shadows)


# The flattened buffers that hold shadows: storage address -> (a weak reference to it, its C++
# storage, its shadows by name). Weak: a buffer the trainer frees is forgotten.
_SHADOWS: dict[int, tuple[StorageWeakRef, int, dict[str, Shadow]]] = {}
_SHADOWS_LOCK = threading.Lock()


def _memory_key(tensor: torch.Tensor) -> tuple:
    """What tells one tensor's memory from another's: where it starts, how it is laid out."""
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def data_section_run(
    sources: Sequence[torch.Tensor], specs: Sequence[WeightSpec], data_bytes: int
) -> torch.Tensor | None:
    """The data section as one uint8 view of the sender's memory, when every tensor's bytes
    (`sources`, flat uint8, in file order) lie at their data offsets in one storage, or, for a
    tied name, its shadow does there (flatten_weights: refreshed here first); else None.
    """
    placed = [(spec, source) for spec, source in zip(specs, sources, strict=True) if spec.nbytes]
    if not placed:
        return None
    first_spec, first = placed[0]
    storage = first.untyped_storage()
    base = first.data_ptr() - first_spec.begin  # where the data section would start
    shadows = shadows_of(storage)
    stale: list[Shadow] = []
    for spec, source in placed:
        if (
            source.device != first.device
            or source.untyped_storage().data_ptr() != storage.data_ptr()
        ):
            return None
        if source.data_ptr() != base + spec.begin:
            at = source.data_ptr() - storage.data_ptr()
            shadow = tied_shadow(shadows, spec.name, at, spec.nbytes)
            if shadow is None or shadow.begin != base + spec.begin - storage.data_ptr():
                return None
            stale.append(shadow)
    start = base - storage.data_ptr()
    if start < 0 or start + data_bytes > storage.nbytes():
        return None
    for shadow in stale:
        refresh_shadow(storage, shadow)
    run = torch.empty(0, dtype=torch.uint8, device=first.device)
    return run.set_(storage, start, (data_bytes,))


def tied_shadow(shadows: Mapping[str, Shadow], name: str, at: int, nbytes: int) -> Shadow | None:
    """The shadow of `name` (shadows_of its buffer) when the tensor sent under that name is its
    source: `nbytes` at byte `at` of the buffer; None when the name has none, or the tensor
    lives elsewhere now."""
    shadow = shadows.get(name)
    if shadow is None or shadow.source != at or shadow.nbytes != nbytes:
        return None
    return shadow


def refresh_shadow(storage: torch.UntypedStorage, shadow: Shadow) -> None:
    """Copy a tied tensor's bytes into its shadow in the flattened buffer `storage` (on the
    current stream: before the device is synchronised or the bytes are sent)."""
    raw = torch.empty(0, dtype=torch.uint8, device=storage.device)
    raw.set_(storage, 0, (storage.nbytes(),))
    with torch.no_grad():
        raw[shadow.begin : shadow.begin + shadow.nbytes].copy_(
            raw[shadow.source : shadow.source + shadow.nbytes]
        )
