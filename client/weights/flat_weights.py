"""Weights that live in one run of memory laid out like the update file's data section.

A trainer that broadcasts its weights every step (WeightsGroup) pays, per broadcast, a fixed
cost in gloo, and a fill copy for every range that crosses a tensor boundary. With the weights
flattened once (`flatten_weights`, the way FSDP keeps flat parameters), the data section of
every later update is one existing run of memory: the broadcasts are plain bucket-sized slices
of it (DistributedSource.contiguous), with no copy on either side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..protocol.errors import InvalidArgument
from .update_file import WeightSpec, safetensors_header

__all__ = ["data_section_run", "flatten_weights"]


def flatten_weights(weights: Mapping[str, torch.Tensor] | torch.nn.Module) -> None:
    """Move every tensor of `weights` into one buffer on their device, each at its offset in
    the update file's data section (the same order update_weights writes). For a module its
    parameters and buffers themselves move (`.data`), so an optimizer keeps working on them.

    Tied weights (one tensor under two names) cannot sit at both offsets: such a state dict
    still updates correctly, through the ranges that follow the tensors.
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
    with torch.no_grad():
        for spec in specs:
            tensor = state_dict[spec.name]
            if not spec.nbytes:
                continue
            place = flat[spec.begin : spec.end].view(tensor.dtype).view(tensor.shape)
            place.copy_(tensor.detach())
            tensor.data = place


def data_section_run(
    sources: Sequence[torch.Tensor], specs: Sequence[WeightSpec], data_bytes: int
) -> torch.Tensor | None:
    """The data section as one uint8 view of the sender's memory, when every tensor's bytes
    (`sources`, flat uint8, in file order) lie at their data offsets in one storage; else None.
    """
    placed = [(spec, source) for spec, source in zip(specs, sources, strict=True) if spec.nbytes]
    if not placed:
        return None
    first_spec, first = placed[0]
    storage = first.untyped_storage()
    base = first.data_ptr() - first_spec.begin  # where the data section would start
    for spec, source in placed:
        if (
            source.device != first.device
            or source.untyped_storage().data_ptr() != storage.data_ptr()
            or source.data_ptr() != base + spec.begin
        ):
            return None
    start = base - storage.data_ptr()
    if start < 0 or start + data_bytes > storage.nbytes():
        return None
    run = torch.empty(0, dtype=torch.uint8, device=first.device)
    return run.set_(storage, start, (data_bytes,))
