"""The staging arena: one host buffer per target model, kept between weight updates.

Why keep it: a fresh buffer of hundreds of MB is mapped by the kernel page by page on first
write, and those page faults capped the applied throughput of an update at a fraction of the
network's. A buffer that already served an update is resident, so the next
update writes into warm memory at memcpy speed.

Memory bound: a model has one arena. It grows (freeing the old buffer before allocating the new
one) only when an update needs more bytes than it holds, and never shrinks by itself, so the
host holds at most one staging copy of the model's largest update so far (the data section of
its safetensors file, in the wire dtype), plus the one chunk being received. `release` gives the
memory back.

Pinned for CUDA models: the arena of a model with parameters on a CUDA device is page-locked
host memory, so the apply's host-to-device copies are direct DMA rather than a pass through the
driver's pageable bounce buffer. Pinning costs once per arena (the arena is kept), never per
update.

Adoption (CPU, full updates): rather than copying the staged tensors into the parameters, the
parameters become views of the arena (StagedUpdate.apply), which saves a whole copy of the model
per update. The arena then swaps buffers with the model: the buffer the model lived in before
(if it was an adopted arena too) becomes the staging buffer of the next update. The bound above
holds: the model's buffer plus one staging buffer.

Sharing: the arenas live in a registry keyed weakly by the model module, so two servers sharing
one loaded model (tests do) share its arena; `lease` makes the holder exclusive for the whole
stage-verify-apply of one update, since the staged tensors are views into the arena.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ...client.protocol.errors import ResourceExhausted
from ..models.memory import take_load_buffer

__all__ = ["StagingArena", "staging_arena"]


class StagingArena:
    """A growable uint8 host buffer; hand out with `lease`, then `take(nbytes)` per update."""

    def __init__(
        self, *, pin_memory: bool = False, model_buffer: torch.Tensor | None = None
    ) -> None:
        # pin_memory: page-locked host memory (only with CUDA; for models on a CUDA device).
        self.pin_memory = pin_memory
        self._buffer: torch.Tensor | None = None
        # The one buffer the model's state-dict tensors live in (models/memory.py, or an adopted
        # arena): the first adoption recycles it instead of allocating a second staging buffer.
        self._model_buffer = model_buffer
        self._lease = threading.Lock()
        self.allocations = 0  # buffers allocated so far (a steady state allocates none)

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    @contextmanager
    def lease(self) -> Iterator[StagingArena]:
        """Hold the arena for one update (waits while another update of the model holds it)."""
        with self._lease:
            yield self

    def take(self, nbytes: int) -> torch.Tensor:
        """The first nbytes of the buffer (uint8, contents undefined), growing it if needed.

        Call only while holding the lease; earlier takes' views must be dead, since they alias.
        """
        if nbytes > self.capacity_bytes:
            self._buffer = None  # free the old buffer first: never two arenas at once
            try:
                self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
            except (RuntimeError, MemoryError) as error:  # torch's allocator: RuntimeError
                raise ResourceExhausted(
                    f"staging the update needs {nbytes} bytes of host memory, which cannot be "
                    f"allocated now ({type(error).__name__})"
                ) from None
            self.allocations += 1
        if self._buffer is None:  # nbytes == 0 and nothing allocated yet
            return torch.empty(0, dtype=torch.uint8)
        return self._buffer[:nbytes]

    def adopted(self) -> None:
        """The staged buffer now backs every tensor of the model: swap roles with the buffer
        that backed them before (None after the first adoption: the loaded storages are gone).

        Call only while holding the lease, after apply rebound every tensor of the model.
        """
        self._buffer, self._model_buffer = self._model_buffer, self._buffer

    def release(self) -> None:
        """Give the buffer back to the allocator (the next update allocates a fresh one)."""
        with self._lease:
            self._buffer = None


_ARENAS: weakref.WeakKeyDictionary[torch.nn.Module, StagingArena] = weakref.WeakKeyDictionary()
_ARENAS_LOCK = threading.Lock()


def staging_arena(model: torch.nn.Module) -> StagingArena:
    """The arena of `model` (created empty on first use; dropped with the model); pinned when
    the model has parameters on a CUDA device."""
    with _ARENAS_LOCK:
        arena = _ARENAS.get(model)
        if arena is None:
            on_cuda = any(tensor.is_cuda for tensor in model.parameters())
            arena = StagingArena(pin_memory=on_cuda, model_buffer=take_load_buffer(model))
            _ARENAS[model] = arena
        return arena
