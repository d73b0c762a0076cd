"""A model's weights in one private buffer: on the CPU handed once to its staging arena, on a
GPU laid out so that an update is one copy.

On CPU, transformers keeps the weights in a copy-on-write mmap of the safetensors file. Then
(1) a trainer rewriting that file in place changes, or (if it shrinks) crashes with SIGBUS, the
weights being served, and (2) the first weight update pays a page fault per 4 KiB of every
parameter, many times the cost of a warm update's apply. One copy at load time, while nothing
is served yet, removes both.

One buffer rather than one allocation per tensor: the first full update adopts the staged tensors
and the buffer becomes the next staging buffer (weights/arena.py, "Adoption"), so a full update
never allocates past the first. The arena takes the buffer from here when it is created
(`take_load_buffer`), so the hand-over happens once per model, however many servers share it.

On a GPU (loading.py, unless ROLLSERVE_FLAT_WEIGHTS=0) the same buffer replaces `module.to`'s
allocation per tensor, in the update file's order: a staged update (its data section in one
arena or in the trainer's flattened buffer) and the parameters then continue together, and the
apply copies runs of tensors at once (weights/copy_runs.py). The parameters stay in it: every
update on a device is a copy into them (the engine's CUDA graphs read them there).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping

import torch

from ...client.protocol.file_order import file_order

__all__ = ["own_memory", "take_load_buffer"]

_ALIGN_BYTES = 64  # every tensor's place in the buffer: a multiple of any itemsize
_BUFFERS: weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()
_BUFFERS_LOCK = threading.Lock()


def own_memory(module: torch.nn.Module, device: torch.device | None = None) -> torch.Tensor:
    """Copy the state dict's tensors into one private buffer on `device` (default: the CPU)
    and rebind them as its views; the buffer.

    The tensors lie in the update file's order (client/protocol/file_order.py; a tied
    tensor once, at its first name), each at a multiple of _ALIGN_BYTES: where their sizes are
    multiples of it (every tensor of the common decoders), back to back. On a GPU that is what
    makes an update one copy (weights/copy_runs.py: the staged data section and the parameters
    then continue together) and the engine's fused projections views rather than copies
    (generation/fused.py: q/k/v and gate/up are neighbours in this order). On the CPU, the
    buffer goes to the model's staging arena (`take_load_buffer`).

    Tensors outside the state dict (non-persistent buffers, which no update rewrites) get copies
    of their own on `device`, never a place in the shared buffer.
    """
    device = torch.device("cpu") if device is None else device
    with torch.no_grad():
        in_state = _in_file_order(module.state_dict(keep_vars=True))
        places, total = [], 0
        for tensor in in_state.values():
            places.append(total)
            total += -(-tensor.nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        for tensor, place in zip(in_state.values(), places, strict=True):
            view = buffer[place : place + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.data)
            tensor.data = view
        for tensor in module.buffers():
            if id(tensor) not in in_state:
                tensor.data = tensor.data.to(device, copy=True)
    if device.type == "cpu":
        with _BUFFERS_LOCK:
            _BUFFERS[module] = buffer
    return buffer


def _in_file_order(state_dict: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The state dict's distinct tensors by id, in the update file's order."""
    entries = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in state_dict.items()]
    ordered: dict[int, torch.Tensor] = {}
    for name, _, _ in file_order(entries):
        ordered.setdefault(id(state_dict[name]), state_dict[name])
    return ordered


def take_load_buffer(module: torch.nn.Module) -> torch.Tensor | None:
    """The buffer `own_memory` put the module's weights in, once (None later, or never owned):
    the staging arena keeps it from then on, and no second reference outlives a release."""
    with _BUFFERS_LOCK:
        return _BUFFERS.pop(module, None)
