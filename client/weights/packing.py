"""`pack=True` for transport "cuda_ipc": the tensors copied into one buffer on their GPU first.

Sent as they are, a model's tensors are one CUDA IPC handle per storage: the server opens,
copies from and closes ~300 of them per update (0.009 x a device copy on an H100, bench/
RESULTS.md). Weights flattened once into one buffer (flat_weights.py) are one handle, which a
server on the same GPU checks and applies in place, with no copy on either side; that is the
fast path, but it moves the trainer's parameters. Packing gets the same single handle without
touching them: one device-to-device copy of the weights per update into a buffer this client
keeps between updates (one copy of the weights more on the trainer's GPU, in the wire dtype).
"""

from __future__ import annotations

import dataclasses

import torch

from ..protocol.errors import ResourceExhausted
from .flat_weights import data_section_run
from .update_file import UpdateFile

__all__ = ["PackBuffer"]


class PackBuffer:
    """One buffer on a GPU laid out like an update's data section, reused by later updates
    (grown when an update needs more, moved when it is on another device). Not thread-safe:
    the caller holds it from packing until the server's reply (the server reads it then)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    @property
    def allocated_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def packed(self, update: UpdateFile) -> UpdateFile:
        """`update` with its tensors copied into the buffer, each at its data-section offset
        (so the data section is one run of one storage); `update` itself when there is nothing
        to gain: tensors on several devices, or already one run (flattened weights)."""
        state_dict = update.state_dict
        _, specs = update.layout()
        data_bytes = specs[-1].end if specs else 0
        devices = {tensor.device for tensor in state_dict.values()}
        if len(devices) != 1 or not data_bytes:
            return update
        sources = [state_dict[spec.name].detach() for spec in specs]
        if data_section_run(sources, specs, data_bytes) is not None:
            return update
        buffer = self._take(devices.pop(), data_bytes)
        views: dict[str, torch.Tensor] = {}
        targets, copied = [], []
        for spec, source in zip(specs, sources, strict=True):
            view = buffer[spec.begin : spec.end].view(source.dtype).view(source.shape)
            views[spec.name] = view
            if spec.nbytes:
                targets.append(view)
                copied.append(source)
        with torch.no_grad():
            torch._foreach_copy_(targets, copied)  # a few kernels, not one copy per tensor
        return dataclasses.replace(update, state_dict=views)

    def release(self) -> None:
        self._buffer = None

    def _take(self, device: torch.device, nbytes: int) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.device != device or buffer.numel() < nbytes:
            self._buffer = None  # the old one goes first: never two at once
            try:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError included
                raise ResourceExhausted(
                    f"pack=True: the packed copy of the weights needs {nbytes} bytes on "
                    f"{device}, which cannot be allocated now ({type(error).__name__}); send "
                    "without pack, or flatten the weights once (flatten_weights)"
                ) from None
            self._buffer = buffer
        return buffer[:nbytes]
