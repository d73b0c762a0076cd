"""Client side of UpdateWeights: a state dict as one safetensors byte stream in fixed-size chunks.

The safetensors file (8-byte little-endian header length, JSON header, data section) is never
built whole: it is produced tensor by tensor and cut at fixed byte offsets regardless of tensor
boundaries. Chunks of 1 MiB (DEFAULT_CHUNK_BYTES) keep gRPC's per-message cost small without
making a Python object so large that building it costs a page-faulting pass (bench/RESULTS.md
has the measurements). A chunk is a list of memoryviews of the tensors' own memory;
`update_weights_messages` joins each with its protobuf framing (protocol/wire.py), the one copy
this side makes. At any moment the generator holds one chunk plus at most one contiguous host
copy of the tensor being read (none for contiguous CPU tensors).

Checksums are verification the caller asks for; neither is on by default.

* Per-chunk CRC-32 (crc32=True; the server verifies every CRC it is sent). It guards the path
  between the two processes: gRPC's and the kernel's copies, host memory, and any HTTP/2 proxy
  that re-frames the stream, which HTTP/2 (no checksum) and TCP (a 16-bit sum, usually checked
  by the NIC) do not cover; Ethernet's CRC covers only the wire, TLS's MAC nearly all of it. It
  costs CPU on both sides for every byte, read from memory rather than cache, which shows in the
  applied throughput of a machine with few cores (bench/RESULTS.md); ISA-L (the optional `isal`
  package) computes it several times faster than zlib. Ask for it across proxies you do not
  control and on hosts without ECC memory; the server's value checks (NaN, infinity, range)
  run regardless.
* The whole-file SHA-256 (sha256=True): the hash must sit in the header, before the first chunk,
  so it costs a complete extra read of every tensor (plus an extra device-to-host copy of each
  GPU tensor); it also proves the file end to end.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...v1 import rollout_pb2 as pb
from ..protocol.dtypes import PROTO_DTYPES, SAFETENSORS_NAMES
from ..protocol.errors import InvalidArgument
from ..protocol.file_order import Entry, file_order
from ..protocol.requests import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    Progress,
    UpdateOptions,
)
from ..protocol.wire import crc32_of_pieces, encode_chunk

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "UpdateFile",
    "WeightSpec",
    "Weights",
    "iter_chunk_pieces",
    "iter_safetensors_bytes",
    "prepare_update",
    "safetensors_header",
    "update_weights_messages",
]


StateDict = Mapping[str, torch.Tensor]
# What update_weights takes: a state dict, or a module whose state dict is sent.
Weights = StateDict | torch.nn.Module


@dataclass(frozen=True)
class WeightSpec:
    """One tensor's header entry; begin/end are byte offsets into the data section."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _as_state_dict(weights: StateDict | torch.nn.Module) -> StateDict:
    state_dict = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    if not isinstance(state_dict, Mapping):
        raise InvalidArgument(f"weights must be a state dict or an nn.Module, got {type(weights)}")
    for name, tensor in state_dict.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise InvalidArgument(f"invalid tensor name {name!r}")
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise InvalidArgument(f"{name}: not a dense torch.Tensor")
        if tensor.is_meta:  # it failed while being sent (NotImplementedError, or UNKNOWN)
            raise InvalidArgument(f"{name}: a meta tensor has no data to send")
        if tensor.dtype not in SAFETENSORS_NAMES:
            supported = ", ".join(str(d).removeprefix("torch.") for d in SAFETENSORS_NAMES)
            raise InvalidArgument(f"{name}: dtype {tensor.dtype} not supported ({supported})")
    return state_dict


def safetensors_header(state_dict: StateDict) -> tuple[bytes, list[WeightSpec]]:
    """The bytes before the data section (length prefix + JSON) and the tensors in file order."""
    layout = _layout(_as_state_dict(state_dict))
    return layout.head, list(layout.specs)


@dataclass(frozen=True)
class _Layout:
    """What a (name, dtype, shape) list makes of an update file: its head, its tensors in file
    order, and the header's manifest of them, serialized (merged into each header: parsing it
    from bytes is ~10x faster than building ~300 TensorSpec messages)."""

    head: bytes
    specs: tuple[WeightSpec, ...]
    manifest: bytes


def _layout(state_dict: StateDict) -> _Layout:
    """The layout of a checked state dict. A trainer sends the same names, dtypes and shapes at
    every step: layouts are remembered by them (~0.05 ms to key 300 tensors, ~1.3 ms to build
    their JSON and manifest)."""
    key = tuple((name, tensor.dtype, tuple(tensor.shape)) for name, tensor in state_dict.items())
    with _LAYOUTS_LOCK:
        known = _LAYOUTS.get(key)
        if known is not None:
            _LAYOUTS.move_to_end(key)
    if known is None:
        known = _build_layout(key)
        with _LAYOUTS_LOCK:
            _LAYOUTS[key] = known
            while len(_LAYOUTS) > _LAYOUTS_KEPT:
                _LAYOUTS.popitem(last=False)
    return known


# The layouts of the last few (name, dtype, shape) lists (a trainer's actor and critic, a LoRA
# adapter and its merged model, ...), newest last.
_LAYOUTS: OrderedDict[tuple, _Layout] = OrderedDict()
_LAYOUTS_LOCK = threading.Lock()
_LAYOUTS_KEPT = 8


def _build_layout(tensors: tuple[Entry, ...]) -> _Layout:
    ordered = file_order(tensors)
    specs: list[WeightSpec] = []
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    cursor = 0
    for name, dtype, shape in ordered:
        nbytes = math.prod(shape) * dtype.itemsize
        spec = WeightSpec(name, SAFETENSORS_NAMES[dtype], shape, cursor, cursor + nbytes)
        specs.append(spec)
        entries[name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [spec.begin, spec.end],
        }
        cursor += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    # Pad with spaces (valid JSON whitespace) so the data section starts 8-byte aligned.
    text += b" " * (-len(text) % 8)
    manifest = pb.WeightsHeader(
        manifest=[
            pb.TensorSpec(name=s.name, dtype=PROTO_DTYPES[s.dtype], shape=s.shape) for s in specs
        ]
    )
    head = len(text).to_bytes(8, "little") + text
    return _Layout(head, tuple(specs), manifest.SerializeToString())


def _tensor_bytes(tensor: torch.Tensor) -> tuple[memoryview, bool]:
    """The tensor's elements as bytes in C order, and whether they are a temporary host copy.

    No copy for a contiguous CPU tensor (the view reads the caller's memory); one otherwise.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        # One host copy, made contiguous on the way (no second copy for non-contiguous views).
        host = tensor.to("cpu", memory_format=torch.contiguous_format)
    else:
        host = tensor.contiguous()  # returns `tensor` itself when already contiguous
    if host.numel() == 0:
        return memoryview(b""), False
    # Through uint8: numpy has no bfloat16, and bytes are what we want anyway. reshape(-1) of a
    # contiguous tensor is a view, so tied weights and slices are read where they live.
    return memoryview(host.reshape(-1).view(torch.uint8).numpy()), host is not tensor


def _pieces(
    state_dict: StateDict,
    header: bytes,
    specs: list[WeightSpec],
    begin: int = 0,
    end: int | None = None,
) -> Iterator[tuple[memoryview, bool]]:
    """The file's bytes in [begin, end) as views of the header and the tensors, in file order.

    Tensors wholly outside the range are not touched (no host copy of a GPU tensor).
    """
    data_start = len(header)
    end = data_start + (specs[-1].end if specs else 0) if end is None else end
    if begin < data_start:
        yield memoryview(header)[begin : min(end, data_start)], False
    for spec in specs:
        first, last = data_start + spec.begin, data_start + spec.end
        if last <= begin or first >= end or first == last:
            continue
        piece, temporary = _tensor_bytes(state_dict[spec.name])
        if len(piece) != spec.nbytes:
            raise InvalidArgument(f"{spec.name}: changed size while being sent")
        yield piece[max(begin, first) - first : min(end, last) - first], temporary
        del piece  # drop this tensor's host copy (if any) before the next one is made


Chunk = list[memoryview | bytes]  # pieces whose concatenation is one chunk of the file


def iter_chunk_pieces(
    state_dict: StateDict | torch.nn.Module,
    chunk_bytes: int,
    begin: int = 0,
    end: int | None = None,
    layout: tuple[bytes, list[WeightSpec]] | None = None,
) -> Iterator[Chunk]:
    """The safetensors file of `state_dict` (or its bytes [begin, end)) as chunks of chunk_bytes
    (the last shorter), each a list of memoryviews into the tensors' memory: joining one is the
    only copy of its bytes.

    A chunk that spans tensors holds a view of each; a temporary host copy (a GPU or a
    non-contiguous tensor) is never kept past its turn: its bytes left over for the next chunk
    (< chunk_bytes) are copied out, so at most one host copy of a tensor exists at a time.
    `layout`: safetensors_header(state_dict) when the caller has it (a checked state dict).
    """
    if chunk_bytes < 1:
        raise InvalidArgument(f"chunk_bytes must be positive, got {chunk_bytes}")
    if layout is None:
        state_dict = _as_state_dict(state_dict)
        layout = safetensors_header(state_dict)
    header, specs = layout
    pending: Chunk = []  # the start of a chunk that spans a tensor boundary
    pending_bytes = 0
    for piece, temporary in _pieces(state_dict, header, specs, begin, end):
        pos = 0
        if pending:
            pos = min(chunk_bytes - pending_bytes, len(piece))
            pending.append(piece[:pos])
            pending_bytes += pos
            if pending_bytes == chunk_bytes:
                yield pending
                pending, pending_bytes = [], 0
        while len(piece) - pos >= chunk_bytes:
            yield [piece[pos : pos + chunk_bytes]]
            pos += chunk_bytes
        if pos < len(piece):
            pending.append(piece[pos:])
            pending_bytes += len(piece) - pos
        if temporary and pending:
            pending[-1] = bytes(pending[-1])  # the only view into this piece that outlives it
        del piece
    if pending:
        yield pending


def iter_safetensors_bytes(
    state_dict: StateDict | torch.nn.Module, chunk_bytes: int
) -> Iterator[bytes]:
    """Yield the safetensors file of `state_dict` in chunks of chunk_bytes (the last shorter)."""
    for pieces in iter_chunk_pieces(state_dict, chunk_bytes):
        yield b"".join(pieces)


def _sha256_hex(state_dict: StateDict, header: bytes, specs: list[WeightSpec]) -> str:
    digest = hashlib.sha256()
    for piece, _ in _pieces(state_dict, header, specs):
        digest.update(piece)
    return digest.hexdigest()


@dataclass(frozen=True)
class UpdateFile:
    """A validated update: its header message and the state dict its file is cut from."""

    header: pb.WeightsHeader
    state_dict: StateDict
    chunk_bytes: int
    crc32: bool
    head: bytes  # the file's length prefix and JSON header
    specs: tuple[WeightSpec, ...]  # its tensors in file order

    @property
    def total_bytes(self) -> int:
        return self.header.total_bytes

    def layout(self) -> tuple[bytes, list[WeightSpec]]:
        """The file's head (length prefix + JSON) and its tensors in file order (made once, by
        prepare_update: ~300 tensors' JSON is milliseconds, and every transport asks for it)."""
        return self.head, list(self.specs)

    def messages(
        self,
        header: pb.WeightsHeader | None = None,
        begin: int = 0,
        end: int | None = None,
        progress: Progress | None = None,
    ) -> Iterator[bytes]:
        """Encoded requests: `header` (default: this file's), then the chunks of bytes
        [begin, end) of the file; `progress(sent, total)` as gRPC takes each message."""
        total_bytes = self.total_bytes
        end = total_bytes if end is None else end
        yield pb.UpdateWeightsRequest(header=header or self.header).SerializeToString()
        if progress is not None:
            progress(0, total_bytes)
        offset = begin
        layout = self.layout()
        for pieces in iter_chunk_pieces(self.state_dict, self.chunk_bytes, begin, end, layout):
            checksum = crc32_of_pieces(pieces) if self.crc32 else None
            yield encode_chunk(offset, pieces, checksum)
            offset += sum(len(piece) for piece in pieces)
            if progress is not None:
                progress(offset - begin, total_bytes)


def prepare_update(
    weights: StateDict | torch.nn.Module,
    *,
    version: int,
    options: UpdateOptions | None = None,
    **fields: Any,
) -> UpdateFile:
    """Check an update and build its header; `options` and/or the fields of UpdateOptions as
    keywords (only those that shape the file count here: target, mode, lora, chunk_bytes, crc32,
    sha256, allow_non_finite, manifest)."""
    options = UpdateOptions.of(options, **fields)
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**64:
        raise InvalidArgument(f"version must be an unsigned 64-bit int, got {version!r}")
    state_dict = _as_state_dict(weights)
    layout = _layout(state_dict)
    header_bytes, specs = layout.head, layout.specs
    header = pb.WeightsHeader(
        target=options.role,
        version=version,
        mode=options.update_mode,
        total_bytes=len(header_bytes) + (specs[-1].end if specs else 0),
        allow_non_finite=options.allow_non_finite,
    )
    if options.manifest:
        header.MergeFromString(layout.manifest)  # the repeated field: appended
    if options.lora is not None:
        header.lora.CopyFrom(options.lora)
    if options.sha256:
        header.sha256 = _sha256_hex(state_dict, header_bytes, list(specs))
    return UpdateFile(header, state_dict, options.chunk_bytes, options.crc32, header_bytes, specs)


def update_weights_messages(
    weights: StateDict | torch.nn.Module,
    *,
    version: int,
    progress: Progress | None = None,
    options: UpdateOptions | None = None,
    **fields: Any,
) -> Iterator[bytes]:
    """The UpdateWeights request stream, encoded: one header message, then the chunks, each as
    the protobuf bytes of an UpdateWeightsRequest (options: see prepare_update).

    Arguments are checked here, before the first message. target and mode take enum values or
    short names ("actor", "full" / "partial" / "lora"). sha256=True reads every tensor twice.
    Each chunk message is one join of a few framing bytes and views of the tensors (wire.py), so
    its payload is copied once; send them with wire.update_weights_callable (a raw-bytes
    serializer). `progress(sent_bytes, total_bytes)` is called as gRPC takes each message.
    """
    update = prepare_update(weights, version=version, options=options, **fields)
    return update.messages(progress=progress)
