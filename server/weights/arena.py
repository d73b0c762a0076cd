"""The staging arena: one buffer per target model, kept between weight updates.

Why keep it: a fresh buffer of hundreds of MB is mapped by the kernel page by page on first
write, and those page faults capped the applied throughput of an update at a fraction of the
network's. A buffer that already served an update is resident, so the next update writes into
warm memory at memcpy speed (and a device buffer needs no new allocation).

Where it lives. A model on the CPU stages in host memory (below). A model on a CUDA device
stages ON THE DEVICE (`device`): bytes arriving on the host pass through a small ring of pinned
slots and are copied asynchronously into the device buffer while the next bytes arrive
(pipeline.py), the value checks run there, and apply copies device to device into the existing
parameter storages. The device buffer is allocated only when it fits in what the device has
free now: the driver's free memory, plus what torch's caching allocator holds unused, plus the
arena's own old buffer (freed first), less DEVICE_MARGIN_BYTES for the allocator's
fragmentation (`device_has_room`, a pure function of those figures). No promises are summed:
the memory plan makes room for the buffer up front instead. The KV budget of a server's
engine (generation/registry.py, kv_cache.py) leaves room for one staging copy of its model's
weights, so on a CUDA server

    weights + one device staging copy of each updated model (kept between updates)
    + KV cache + activation reserve  <=  --gpu-memory-utilization x the device's memory,

as long as an update's wire dtype is the model's (a wider one stages more than was reserved,
and is allocated only if it fits in what is free then). When the buffer cannot be had (no
room, an allocation that fails, or an update over
`device_limit_bytes`), the update stages in pinned host memory instead, as a model on the CPU
does, and apply copies host to device. A failed
allocation is final for the arena (retrying would reallocate both buffers each update); the
room check is retried at the next update that would need a new device buffer.

Memory bound: a model has one arena. Its buffer grows (freeing the old buffer before allocating
the new one) only when an update needs more bytes than it holds, and never shrinks by itself.
So:

* CPU model: the host holds one staging copy of the model's largest update so far (the data
  section of its safetensors file, in the wire dtype), plus the one chunk being received.
* CUDA model: the device holds one staging copy of the largest update's data section, in the
  wire dtype (a float32 update into a bfloat16 model stages twice the model's size); the host
  holds only the ring, at most RING_SLOTS x SLOT_BYTES of pinned memory (pipeline.py), plus the
  chunk being received (and, when a value check fails, a host copy of that one tensor to word
  the refusal). Applying needs no further device memory (copy_ casts in its kernel). An update
  staged in place (CUDA IPC weights flattened on the model's GPU, stream.py) takes no buffer.
  After a fall back to the host, the bound is the CPU model's, in pinned memory.

`release` gives all of it back.

Adoption (CPU, full updates): rather than copying the staged tensors into the parameters, the
parameters become views of the arena (StagedUpdate.apply), which saves a whole copy of the model
per update. The arena then swaps buffers with the model: the buffer the model lived in before
(if it was an adopted arena too) becomes the staging buffer of the next update. The bound above
holds: the model's buffer plus one staging buffer. Never on a device: the generation engine's
CUDA graphs read the parameters' storages, which must not move.

Sharing: the arenas live in a registry keyed weakly by the model module, so two servers sharing
one loaded model (tests do) share its arena; `lease` makes the holder exclusive for the whole
stage-verify-apply of one update, since the staged tensors are views into the arena, and waits
for the copy stream when it ends, so no copy of a failed update still writes into the buffer.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ...client.protocol.errors import ResourceExhausted
from ..models.memory import take_load_buffer
from .layout import VerifiedHead
from .pipeline import SlotRing

__all__ = [
    "DEVICE_MARGIN_BYTES",
    "StagingArena",
    "device_has_room",
    "set_staging_arena",
    "staging_arena",
]

_LOG = logging.getLogger(__name__)
# What a new device buffer must leave of the memory it could take: the caching allocator's
# rounding and fragmentation (its cached blocks may not be one block of the size needed) and
# the CUDA context's small late allocations. The memory plan (kv_cache.py) already reserved
# the buffer itself, so this stays small and fixed rather than a share of the device.
DEVICE_MARGIN_BYTES = 256 << 20


def device_has_room(*, free: int, cached: int, held: int, nbytes: int, margin: int) -> bool:
    """Whether a new buffer of `nbytes` fits on a device: `free` bytes the driver has free,
    `cached` bytes torch's caching allocator holds unused (reserved - allocated), `held` bytes
    of the arena's old device buffer (freed before the new one is allocated), with `margin`
    bytes left over."""
    return free + cached + held - nbytes >= margin


class StagingArena:
    """A growable uint8 buffer; hand out with `lease`, then `take(nbytes)` per update."""

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        pin_memory: bool = False,
        model_buffer: torch.Tensor | None = None,
        device_limit_bytes: int | None = None,
        ring: SlotRing | None = None,
    ) -> None:
        # device: stage there, pipelined (pipeline.py); None: stage in host memory. A "cpu"
        # device runs the pipelined path on the host (how the CPU tests exercise it).
        self.device = None if device is None else torch.device(device)
        # pin_memory: page-locked host memory (only with CUDA): the ring, and the host buffer
        # of a CUDA model that stages on the host.
        self.pin_memory = pin_memory
        # device_limit_bytes: an update whose staging copy is larger stages on the host.
        self.device_limit_bytes = device_limit_bytes
        # ring: the host slots of a device arena (default: RING_SLOTS x SLOT_BYTES).
        self.ring = ring if ring is not None else SlotRing(pin_memory=pin_memory)
        self._copy_stream: torch.cuda.Stream | None = None
        self._buffer: torch.Tensor | None = None
        self._on_device = False  # whether _buffer is the device buffer
        self._device_refused = False  # the device could not hold the buffer: stage on the host
        self._room_refusal_logged = False  # the no-room warning is given once per arena
        # The one buffer the model's state-dict tensors live in (models/memory.py, or an adopted
        # arena): the first adoption recycles it instead of allocating a second staging buffer.
        self._model_buffer = model_buffer
        self._lease = threading.Lock()
        self.allocations = 0  # buffers allocated so far (a steady state allocates none)
        # The last head that passed its checks, with the staged views of the last update
        # (stream.py, VerifiedHead): an update with the same head reuses them. The views are
        # dropped whenever the buffer they view is (`_drop_views`).
        self.verified_head: VerifiedHead | None = None

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def staged_on_device(self) -> bool:
        """Whether the buffer of the last `take` is the device buffer (pipelined staging)."""
        return self._on_device

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """The stream of the host-to-device copies and device checks (None on the CPU)."""
        if self._copy_stream is None and self.device is not None and self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream

    @contextmanager
    def lease(self) -> Iterator[StagingArena]:
        """Hold the arena for one update (waits while another update of the model holds it).

        On the way out, waits for the copies still in flight (a failed update's), so the next
        holder may free or rewrite the buffer."""
        with self._lease:
            try:
                yield self
            finally:
                if self._copy_stream is not None:
                    self._copy_stream.synchronize()

    def take(self, nbytes: int) -> torch.Tensor:
        """The first nbytes of the buffer (uint8, contents undefined), growing it if needed: on
        the device when the arena has one and the device can hold it, else in host memory.

        Call only while holding the lease; earlier takes' views must be dead, since they alias.
        """
        on_device = self._wants_device(nbytes)
        if self._buffer is None or on_device != self._on_device or nbytes > self.capacity_bytes:
            self._drop_views()
            self._buffer = None  # free the old buffer first: never two arenas at once
            self._on_device = on_device
            if on_device:
                self._buffer = self._device_buffer(nbytes)
                self._on_device = self._buffer is not None
            if self._buffer is None:
                self._buffer = self._host_buffer(nbytes)
            self.allocations += 1
            # Rare (growth, or a switch between device and host), and the one place that says
            # where updates stage (bench_gpu_weights.py reads it from the server's log).
            _LOG.info("staging buffer of %d bytes %s", nbytes, self._where())
        return self._buffer[:nbytes]

    def _where(self) -> str:
        if self._on_device:
            return f"on {self.device}"
        return "in pinned host memory" if self.pin_memory else "in host memory"

    def _wants_device(self, nbytes: int) -> bool:
        if self.device is None or self._device_refused:
            return False
        if self.device_limit_bytes is not None and nbytes > self.device_limit_bytes:
            return False
        if self._on_device and nbytes <= self.capacity_bytes:
            return True  # the buffer is there: nothing to allocate
        return self._device_has_room(nbytes)

    def _device_has_room(self, nbytes: int) -> bool:
        """device_has_room with the device's figures now; the first refusal is logged."""
        assert self.device is not None
        if self.device.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        held = self.capacity_bytes if self._on_device else 0  # freed before the new one
        margin = DEVICE_MARGIN_BYTES
        if device_has_room(free=free, cached=cached, held=held, nbytes=nbytes, margin=margin):
            return True
        if not self._room_refusal_logged:  # once per arena: every update would repeat it
            self._room_refusal_logged = True
            _LOG.warning(
                "staging %d bytes on %s does not fit (%d bytes free, %d cached unused by torch, "
                "%d in the old staging buffer, %d kept as a margin); updates that need a new "
                "buffer stage in host memory while this lasts",
                nbytes,
                self.device,
                free,
                cached,
                held,
                margin,
            )
        return False

    def _device_buffer(self, nbytes: int) -> torch.Tensor | None:
        assert self.device is not None
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
            # From now on this model stages in (pinned) host memory, as before there were
            # device arenas: retrying every update would reallocate both buffers each time.
            self._device_refused = True
            _LOG.warning(
                "staging %d bytes on %s failed (%s); this model's updates stage in host memory "
                "from now on",
                nbytes,
                self.device,
                type(error).__name__,
            )
            return None

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        except (RuntimeError, MemoryError) as error:  # torch's allocator: RuntimeError
            where = "" if self.device is None else f" ({self.device} could not hold it either)"
            raise ResourceExhausted(
                f"staging the update needs {nbytes} bytes of host memory{where}, which cannot "
                f"be allocated now ({type(error).__name__})"
            ) from None

    def adopted(self) -> None:
        """The staged buffer now backs every tensor of the model: swap roles with the buffer
        that backed them before (None after the first adoption: the loaded storages are gone).

        Call only while holding the lease, after apply rebound every tensor of the model.
        """
        self._buffer, self._model_buffer = self._model_buffer, self._buffer

    def release(self) -> None:
        """Give the buffer and the ring back to the allocators (the next update allocates)."""
        with self._lease:
            self._drop_views()
            self._buffer = None
            self._on_device = False
            self.ring.clear()

    def forget_head(self) -> None:
        """Check the next update's head anew (the model changed under a remembered one)."""
        self.verified_head = None

    def _drop_views(self) -> None:
        """Views of the buffer keep it alive: drop them before the buffer is let go."""
        if self.verified_head is not None:
            self.verified_head.views.clear()


_ARENAS: weakref.WeakKeyDictionary[torch.nn.Module, StagingArena] = weakref.WeakKeyDictionary()
_ARENAS_LOCK = threading.Lock()


def staging_arena(model: torch.nn.Module) -> StagingArena:
    """The arena of `model` (created empty on first use; dropped with the model): on the CUDA
    device of the model's parameters when it has some, else in host memory."""
    with _ARENAS_LOCK:
        arena = _ARENAS.get(model)
        if arena is None:
            device = next((t.device for t in model.parameters() if t.is_cuda), None)
            arena = StagingArena(
                device=device,
                pin_memory=device is not None,
                model_buffer=take_load_buffer(model),
            )
            _ARENAS[model] = arena
        return arena


def set_staging_arena(model: torch.nn.Module, arena: StagingArena) -> None:
    """Stage the updates of `model` in `arena` from now on (before its first update; e.g. a
    pipelined arena on the CPU, or one with a device_limit_bytes)."""
    with _ARENAS_LOCK:
        _ARENAS[model] = arena
