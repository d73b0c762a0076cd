"""Client side of UpdateWeights: a state dict as one safetensors byte stream in fixed-size chunks.

The safetensors file (8-byte little-endian header length, JSON header, data section) is never
built whole: it is produced tensor by tensor and cut at fixed byte offsets regardless of tensor
boundaries (reference/transport.md: 1 MiB messages are the fastest here, and a Python object of
32 MiB or more costs a page-faulting pass). A chunk is a list of memoryviews of the tensors' own
memory; `update_weights_messages` joins each with its protobuf framing (client/wire.py), the one
copy this side makes. At any moment the generator holds one chunk plus at most one contiguous
host copy of the tensor being read (none for contiguous CPU tensors).

Checksums are verification the caller asks for; neither is on by default.

* Per-chunk CRC-32 (crc32=True; the server verifies every CRC it is sent). It guards the path
  between the two processes: gRPC's and the kernel's copies, host memory, and any HTTP/2 proxy
  that re-frames the stream, which HTTP/2 (no checksum) and TCP (a 16-bit sum, usually checked
  by the NIC) do not cover; Ethernet's CRC covers only the wire, TLS's MAC nearly all of it. Its
  price is large on small machines: measured end to end on the 2-core dev VM, it cuts the
  applied throughput by about a fifth (median ratio to raw TCP 0.265 without, 0.217 with,
  paired rounds, ISA-L on both sides; bench/RESULTS.md), i.e. ~0.08 CPU-s per GiB on the client
  and ~0.15 on the server, where the data is read from memory rather than cache. zlib instead of
  ISA-L (the optional `isal` package) costs 3.3x more. Ask for it across proxies you do not
  control and on hosts without ECC memory; the server's value checks (NaN, infinity, range)
  run regardless.
* The whole-file SHA-256 (sha256=True): the hash must sit in the header, before the first chunk,
  so it costs a complete extra read of every tensor (about 1.5 GiB/s per core with SHA-NI, plus
  an extra device-to-host copy of each GPU tensor); it also proves the file end to end.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ...v1 import rollout_pb2 as pb
from ..protocol.dtypes import PROTO_DTYPES, SAFETENSORS_NAMES
from ..protocol.errors import InvalidArgument
from ..protocol.wire import crc32_of_pieces, encode_chunk

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "UpdateFile",
    "WeightSpec",
    "iter_chunk_pieces",
    "iter_safetensors_bytes",
    "prepare_update",
    "safetensors_header",
    "update_weights_messages",
]

MIN_CHUNK_BYTES = 256 * 1024
MAX_CHUNK_BYTES = 64 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 1024 * 1024

StateDict = Mapping[str, torch.Tensor]


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
        if tensor.dtype not in SAFETENSORS_NAMES:
            supported = ", ".join(str(d).removeprefix("torch.") for d in SAFETENSORS_NAMES)
            raise InvalidArgument(f"{name}: dtype {tensor.dtype} not supported ({supported})")
    return state_dict


def safetensors_header(state_dict: StateDict) -> tuple[bytes, list[WeightSpec]]:
    """The bytes before the data section (length prefix + JSON) and the tensors in file order."""
    state_dict = _as_state_dict(state_dict)
    # Wider dtypes first (stable within a width): every tensor then starts at a multiple of its
    # itemsize, so a receiver can view its bytes in place. safetensors.torch.save does the same.
    names = sorted(state_dict, key=lambda n: -state_dict[n].dtype.itemsize)
    specs: list[WeightSpec] = []
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    cursor = 0
    for name in names:
        tensor = state_dict[name]
        nbytes = math.prod(tensor.shape) * tensor.dtype.itemsize
        spec = WeightSpec(
            name, SAFETENSORS_NAMES[tensor.dtype], tuple(tensor.shape), cursor, cursor + nbytes
        )
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
    return len(text).to_bytes(8, "little") + text, specs


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
) -> Iterator[Chunk]:
    """The safetensors file of `state_dict` (or its bytes [begin, end)) as chunks of chunk_bytes
    (the last shorter), each a list of memoryviews into the tensors' memory: joining one is the
    only copy of its bytes.

    A chunk that spans tensors holds a view of each; a temporary host copy (a GPU or a
    non-contiguous tensor) is never kept past its turn: its bytes left over for the next chunk
    (< chunk_bytes) are copied out, so at most one host copy of a tensor exists at a time.
    """
    if chunk_bytes < 1:
        raise InvalidArgument(f"chunk_bytes must be positive, got {chunk_bytes}")
    state_dict = _as_state_dict(state_dict)
    header, specs = safetensors_header(state_dict)
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


def _enum_value(enum: object, prefix: str, value: int | str, field: str) -> int:
    """Accept an enum number or a short name ("actor", "partial")."""
    if isinstance(value, str):
        try:
            return enum.Value(prefix + value.upper())  # type: ignore[attr-defined]
        except ValueError:
            raise InvalidArgument(f"{field}: unknown name {value!r}") from None
    if value not in enum.values():  # type: ignore[attr-defined]
        raise InvalidArgument(f"{field}: unknown value {value!r}")
    return int(value)


def _sha256_hex(state_dict: StateDict) -> str:
    digest = hashlib.sha256()
    header, specs = safetensors_header(state_dict)
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

    @property
    def total_bytes(self) -> int:
        return self.header.total_bytes

    def layout(self) -> tuple[bytes, list[WeightSpec]]:
        """The file's head (length prefix + JSON) and its tensors in file order."""
        return safetensors_header(self.state_dict)

    def messages(
        self,
        header: pb.WeightsHeader | None = None,
        begin: int = 0,
        end: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Iterator[bytes]:
        """Encoded requests: `header` (default: this file's), then the chunks of bytes
        [begin, end) of the file; `progress(sent, total)` as gRPC takes each message."""
        total_bytes = self.total_bytes
        end = total_bytes if end is None else end
        yield pb.UpdateWeightsRequest(header=header or self.header).SerializeToString()
        if progress is not None:
            progress(0, total_bytes)
        offset = begin
        for pieces in iter_chunk_pieces(self.state_dict, self.chunk_bytes, begin, end):
            checksum = crc32_of_pieces(pieces) if self.crc32 else None
            yield encode_chunk(offset, pieces, checksum)
            offset += sum(len(piece) for piece in pieces)
            if progress is not None:
                progress(offset - begin, total_bytes)


def prepare_update(
    weights: StateDict | torch.nn.Module,
    *,
    target: int | str,
    version: int,
    mode: int | str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    crc32: bool = False,
    sha256: bool = False,
    lora: pb.LoraAdapter | None = None,
    allow_non_finite: bool = False,
    manifest: bool = True,
) -> UpdateFile:
    """Validate the arguments of an update and build its header (see update_weights_messages)."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise InvalidArgument(
            f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}"
        )
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**64:
        raise InvalidArgument(f"version must be an unsigned 64-bit int, got {version!r}")
    role = _enum_value(pb.ModelRole, "MODEL_ROLE_", target, "target")
    update_mode = _enum_value(pb.UpdateMode, "UPDATE_MODE_", mode, "mode")
    if (update_mode == pb.UPDATE_MODE_LORA) != (lora is not None):
        raise InvalidArgument("lora must be given exactly when mode is UPDATE_MODE_LORA")
    state_dict = _as_state_dict(weights)
    header_bytes, specs = safetensors_header(state_dict)
    header = pb.WeightsHeader(
        target=role,
        version=version,
        mode=update_mode,
        total_bytes=len(header_bytes) + (specs[-1].end if specs else 0),
        allow_non_finite=allow_non_finite,
    )
    if manifest:
        header.manifest.extend(
            pb.TensorSpec(name=s.name, dtype=PROTO_DTYPES[s.dtype], shape=s.shape) for s in specs
        )
    if lora is not None:
        header.lora.CopyFrom(lora)
    if sha256:
        header.sha256 = _sha256_hex(state_dict)
    return UpdateFile(header, state_dict, chunk_bytes, crc32)


def update_weights_messages(
    weights: StateDict | torch.nn.Module,
    *,
    target: int | str,
    version: int,
    mode: int | str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    crc32: bool = False,
    sha256: bool = False,
    lora: pb.LoraAdapter | None = None,
    allow_non_finite: bool = False,
    manifest: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[bytes]:
    """The UpdateWeights request stream, encoded: one header message, then the chunks, each as
    the protobuf bytes of an UpdateWeightsRequest.

    Arguments are validated here, before the first message. target and mode take enum values or
    short names ("actor", "full" / "partial" / "lora"). sha256=True reads every tensor twice.
    Each chunk message is one join of a few framing bytes and views of the tensors (wire.py), so
    its payload is copied once; send them with wire.update_weights_callable (a raw-bytes
    serializer). `progress(sent_bytes, total_bytes)` is called as gRPC takes each message.
    """
    update = prepare_update(
        weights, target=target, version=version, mode=mode, chunk_bytes=chunk_bytes,
        crc32=crc32, sha256=sha256, lora=lora, allow_non_finite=allow_non_finite,
        manifest=manifest,
    )  # fmt: skip
    return update.messages(progress=progress)
