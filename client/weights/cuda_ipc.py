"""The trainer side of transport "cuda_ipc": CUDA tensors handed to a server on this host as CUDA
IPC handles, so that the server copies them device to device.

`export_cuda_ipc` describes the update's data section as a CudaIpcSource: one buffer per
distinct CUDA storage (torch's `UntypedStorage._share_cuda_()`, deduplicated by the storage's
address, so a plain state dict needs no flattening copy and weights flattened into one buffer,
flat_weights.py, are one buffer and one span), and spans that tile the data section in file
order, each a run of bytes of one buffer (neighbours that lie back to back in one storage are
one span). The stream itself carries only the header and the file's head.

Lifetime (rollout.proto, CudaIpcSource): the values must be final before the header leaves
(every device the tensors are on is synchronised first: the server reads on its own streams and
cannot wait on ours), and the memory must stay allocated and unchanged until the reply:
`CudaIpcExport` holds every storage the spans read (and the contiguous copies of non-contiguous
tensors) until the caller drops it after the call.

Each storage is exported once (`CudaIpcExports`, one per client: each server gives back what it
was handed). `_share_cuda_` wraps the storage in a new producer-side record with a ref counter
and an interprocess event each time it is called, kept until the storage is freed: exporting
the same parameters at every step would grow that chain by one record per storage per update
(host memory, counter slots in /dev/shm, CUDA events) for as long as the trainer runs. So the
first update of a storage carries its ref counter, which that server gives back; later updates
of the same live storage resend its description without a counter (nothing to give back). A
freed storage is forgotten, and a new storage at the same address is exported anew. torch's
interprocess event is never sent: the device is synchronised before the header leaves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ...v1 import rollout_pb2 as pb
from ..protocol.cuda_ipc import MAX_BUFFERS, MAX_SPANS, cuda_ipc_host_id, device_uuid
from .flat_weights import Shadow, refresh_shadow, shadows_of, tied_shadow
from .update_file import UpdateFile

__all__ = [
    "CudaIpcExport",
    "CudaIpcExports",
    "Run",
    "all_on_cuda",
    "check_on_cuda",
    "export_cuda_ipc",
    "merged_runs",
]

_LOG = logging.getLogger(__name__)


def all_on_cuda(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor is on a CUDA device (and there is one); no torch.cuda call."""
    return bool(state_dict) and all(t.device.type == "cuda" for t in state_dict.values())


def check_on_cuda(state_dict: Mapping[str, torch.Tensor]) -> None:
    """ValueError unless every tensor is on a CUDA device; no torch.cuda call."""
    off_cuda = [name for name, tensor in state_dict.items() if tensor.device.type != "cuda"]
    if off_cuda:
        raise ValueError(
            f"transport 'cuda_ipc' sends CUDA tensors only; {len(off_cuda)} tensor(s) are not "
            f"on a CUDA device (first: {off_cuda[0]!r} on "
            f"{state_dict[off_cuda[0]].device}); use 'shm', 'grpc' or 'auto' for them"
        )


@dataclass
class CudaIpcExport:
    """An update's data section as CUDA IPC buffers, and what must live until the reply."""

    source: pb.CudaIpcSource
    # The storages the spans read (and the contiguous copies of non-contiguous tensors):
    # dropped by the caller once the call has ended, never before.
    keep_alive: list[object] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)  # non-contiguous tensors sent as copies


class CudaIpcExports:
    """Each live storage's CUDA IPC description, made once by torch's `_share_cuda_` and resent
    by later updates without its ref counter (see the module). One per client."""

    def __init__(self) -> None:
        # (the C++ storage, its address, its size) -> a weak reference to it, its description
        self._described: dict[tuple[int, int, int], tuple[StorageWeakRef, pb.CudaIpcBuffer]] = {}
        self._lock = threading.Lock()

    def describe(self, storage: torch.UntypedStorage, uuid: str) -> pb.CudaIpcBuffer:
        key = (storage._cdata, storage.data_ptr(), storage.nbytes())
        with self._lock:
            known = self._described.get(key)
            if known is not None and not known[0].expired():
                again = pb.CudaIpcBuffer()
                again.CopyFrom(known[1])
                again.ClearField("ref_counter_handle")  # given back by the first update
                again.ClearField("ref_counter_offset")
                return again
            for stale in [k for k, (weak, _) in self._described.items() if weak.expired()]:
                del self._described[stale]  # freed storages
            buffer = _shared(storage, uuid)
            self._described[key] = (StorageWeakRef(storage), buffer)
            return buffer

    def __len__(self) -> int:
        return len(self._described)


def export_cuda_ipc(update: UpdateFile, exports: CudaIpcExports | None = None) -> CudaIpcExport:
    """Describe the update's data section as CUDA IPC buffers and spans (see the module);
    `exports`: the client's descriptions of storages it exported before (None: export anew).

    ValueError when a tensor is not on a CUDA device. Non-contiguous tensors are copied into
    contiguous memory first (logged: a copy the trainer can avoid).
    """
    state_dict = update.state_dict
    check_on_cuda(state_dict)
    head, specs = update.layout()
    data_start = len(head)
    export = CudaIpcExport(pb.CudaIpcSource(host_id=cuda_ipc_host_id()))
    # storage address -> its index (addresses are unique across a process's CUDA devices:
    # unified virtual addressing), its storage, its device
    buffers: dict[int, int] = {}
    storages: list[torch.UntypedStorage] = []
    devices: list[torch.device] = []
    shadows: list[Mapping[str, Shadow]] = []  # each buffer's (flat_weights.shadows_of)
    runs: list[tuple[int, int, int, int]] = []  # Run's fields: a tuple each is ~3x cheaper
    for spec in specs:
        begin, end = data_start + spec.begin, data_start + spec.end
        if begin == end:
            continue
        tensor = state_dict[spec.name]
        if not tensor.is_contiguous():
            tensor = tensor.detach().contiguous()
            export.copied.append(spec.name)
            export.keep_alive.append(tensor)  # the storages below hold everything else
        storage = tensor.untyped_storage()
        base = storage.data_ptr()
        index = buffers.get(base)
        if index is None:
            index = buffers[base] = len(storages)
            storages.append(storage)
            devices.append(tensor.device)
            shadows.append(shadows_of(storage))
        offset = tensor.data_ptr() - base
        shadow = tied_shadow(shadows[index], spec.name, offset, end - begin)
        if shadow is not None:
            refresh_shadow(storage, shadow)  # a tied name: its bytes where the file has them
            offset = shadow.begin
        runs.append((begin, end, index, offset))
    spans = merged_runs(runs)
    for run in spans:
        export.source.spans.add(begin=run.begin, end=run.end, buffer=run.buffer, offset=run.offset)
    if len(storages) > MAX_BUFFERS or len(spans) > MAX_SPANS:
        raise ValueError(
            f"transport 'cuda_ipc': {len(storages)} storages and {len(spans)} "
            f"runs of memory; a server takes at most {MAX_BUFFERS} and {MAX_SPANS} "
            "(flatten the weights into one buffer, see WeightsGroup.flatten_weights)"
        )
    if export.copied:
        _LOG.warning(
            "cuda_ipc: %d non-contiguous tensor(s) were copied to contiguous memory to be sent "
            "(first: %s); send contiguous tensors to avoid the copy",
            len(export.copied),
            export.copied[0],
        )
    # The server reads the memory from its own streams: every write to it must be done.
    for device in set(devices):
        torch.cuda.synchronize(device)
    uuids: dict[torch.device, str] = {}
    for device, storage in zip(devices, storages, strict=True):
        if device not in uuids:
            uuids[device] = device_uuid(device)
        if exports is None:
            export.source.buffers.append(_shared(storage, uuids[device]))
        else:
            export.source.buffers.append(exports.describe(storage, uuids[device]))
        export.keep_alive.append(storage)
    return export


class Run(NamedTuple):
    """File bytes [begin, end) at byte `offset` of buffer number `buffer` (a CudaIpcSpan)."""

    begin: int
    end: int
    buffer: int
    offset: int


def merged_runs(runs: Iterable[tuple[int, int, int, int]]) -> list[Run]:
    """The runs (Runs, or tuples of their fields) in file order with each merged into the
    previous one where it continues it, in the file and in the same buffer (weights flattened
    into one buffer become one span). Tuples here, one protobuf span each at the end: ~0.3 ms
    less per 300 tensors than growing the message tensor by tensor."""
    merged: list[Run] = []
    last: list[int] | None = None  # the run being merged: [begin, end, buffer, offset]
    for begin, end, buffer, offset in runs:
        if (
            last is not None
            and last[2] == buffer
            and last[1] == begin
            and last[3] + (last[1] - last[0]) == offset
        ):
            last[1] = end
            continue
        if last is not None:
            merged.append(Run(*last))
        last = [begin, end, buffer, offset]
    if last is not None:
        merged.append(Run(*last))
    return merged


def _shared(storage: torch.UntypedStorage, uuid: str) -> pb.CudaIpcBuffer:
    """The CudaIpcBuffer of one storage (torch's own export, as torch.multiprocessing does)."""
    (
        device,
        handle,
        storage_bytes,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        _event_handle,
        _event_sync_required,
    ) = storage._share_cuda_()
    # torch's event (recorded on the current stream) is not sent: export_cuda_ipc synchronised
    # the whole device first, which orders every write before the header, and the server would
    # open, wait for and destroy one interprocess event per storage per update for nothing.
    return pb.CudaIpcBuffer(
        device_uuid=uuid,
        device=int(device),
        handle=bytes(handle),
        storage_bytes=int(storage_bytes),
        storage_offset=int(storage_offset),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
    )
