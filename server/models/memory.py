"""A CPU model's weights in one private buffer, handed once to the model's staging arena.

On CPU, transformers keeps the weights in a copy-on-write mmap of the safetensors file. Then
(1) a trainer rewriting that file in place changes, or (if it shrinks) crashes with SIGBUS, the
weights being served, and (2) the first weight update pays a page fault per 4 KiB of every
parameter, many times the cost of a warm update's apply. One copy at load time, while nothing
is served yet, removes both.

One buffer rather than one allocation per tensor: the first full update adopts the staged tensors
and the buffer becomes the next staging buffer (weights/arena.py, "Adoption"), so a full update
never allocates past the first. The arena takes the buffer from here when it is created
(`take_load_buffer`), so the hand-over happens once per model, however many servers share it.
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["own_memory", "take_load_buffer"]

_ALIGN_BYTES = 64  # every tensor's place in the buffer: a multiple of any itemsize
_BUFFERS: weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()
_BUFFERS_LOCK = threading.Lock()


def own_memory(module: torch.nn.Module) -> None:
    """Copy the state dict's tensors into one private buffer and rebind them as its views.

    Tensors outside the state dict (non-persistent buffers, which no update rewrites) get copies
    of their own, never a place in the shared buffer.
    """
    with torch.no_grad():
        in_state = {id(t): t for t in module.state_dict(keep_vars=True).values()}  # shared: once
        places, total = [], 0
        for tensor in in_state.values():
            places.append(total)
            total += -(-tensor.nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        buffer = torch.empty(total, dtype=torch.uint8)
        for tensor, place in zip(in_state.values(), places, strict=True):
            view = buffer[place : place + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.data)
            tensor.data = view
        for tensor in module.buffers():
            if id(tensor) not in in_state:
                tensor.data = tensor.data.clone()
    with _BUFFERS_LOCK:
        _BUFFERS[module] = buffer


def take_load_buffer(module: torch.nn.Module) -> torch.Tensor | None:
    """The buffer `own_memory` put the module's weights in, once (None later, or never owned):
    the staging arena keeps it from then on, and no second reference outlives a release."""
    with _BUFFERS_LOCK:
        return _BUFFERS.pop(module, None)
