"""UpdateWeights on the wire without the protobuf runtime in the bulk path.

The bytes are exactly the protobuf encoding of rollout.proto's UpdateWeightsRequest, so any
protobuf client or server interoperates with these functions; only the copies differ. With upb,
a 1 MiB chunk costs a copy into the message, a copy to serialize, and on the server a copy out of
the parsed message on every `.data` read. Here:

* the client writes each chunk message with one `b"".join` of a few header bytes and memoryviews
  of the tensors' own memory (the only user-space copy it makes), and hands those bytes to gRPC
  through a raw-bytes serializer (`update_weights_callable`);
* the server parses a chunk message by hand and keeps a memoryview of `data` inside the bytes
  gRPC received (no copy); header messages, which are small, go through protobuf.

The server's parser is deliberately a strict subset of protobuf's: every message a protobuf
serializer writes for these types parses to the same values, but a chunk with an unknown or
repeated field, or a request that is not exactly one header or one chunk, is refused as
malformed (a chunk field this server does not know might change how `data` must be read). The
parser never raises: gRPC would turn that into INTERNAL; it returns a MalformedRequest instead,
which the stream consumer turns into InvalidArgument.

CRC-32 (WeightsChunk.crc32, the zlib polynomial) is computed by ISA-L when the optional `isal`
package is importable, and by zlib otherwise (several times slower; bench/RESULTS.md has both);
both give identical values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from ...v1 import rollout_pb2 as pb

__all__ = [
    "CRC32_IMPLEMENTATION",
    "AtOnceMessages",
    "UPDATE_WEIGHTS_AT_ONCE_METHOD",
    "UPDATE_WEIGHTS_METHOD",
    "MalformedRequest",
    "WireChunk",
    "crc32",
    "crc32_of_pieces",
    "encode_at_once",
    "encode_chunk",
    "encode_varint",
    "parse_update_at_once",
    "parse_update_request",
    "update_weights_at_once_callable",
    "update_weights_callable",
]

UPDATE_WEIGHTS_METHOD = "/rollserve.v1.Rollout/UpdateWeights"
UPDATE_WEIGHTS_AT_ONCE_METHOD = "/rollserve.v1.Rollout/UpdateWeightsAtOnce"

crc32: Callable[..., int]  # crc32(data, value=0) -> int, zlib's signature and values
try:
    from isal.isal_zlib import crc32  # type: ignore[no-redef]

    CRC32_IMPLEMENTATION = "isal"
except ImportError:  # the optional accelerator is absent: the standard library's
    from zlib import crc32  # type: ignore[no-redef,assignment]

    CRC32_IMPLEMENTATION = "zlib"

# Wire types and the tags (field_number << 3 | wire_type) of the two messages.
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_REQUEST_HEADER = 1 << 3 | _LEN  # UpdateWeightsRequest.header
_REQUEST_CHUNK = 2 << 3 | _LEN  # UpdateWeightsRequest.chunk
_REQUEST_SHM_WRITTEN = 3 << 3 | _LEN  # UpdateWeightsRequest.shm_written
_AT_ONCE_MESSAGE = 1 << 3 | _LEN  # UpdateWeightsAtOnceRequest.messages (repeated)
_CHUNK_OFFSET = 1 << 3 | _VARINT  # WeightsChunk.offset (uint64)
_CHUNK_DATA = 2 << 3 | _LEN  # WeightsChunk.data (bytes)
_CHUNK_CRC32 = 3 << 3 | _FIXED32  # WeightsChunk.crc32 (optional fixed32)
_MAX_VARINT_BYTES = 10
_U64_LIMIT = 1 << 64


@dataclass(frozen=True, slots=True)
class WireChunk:
    """A parsed WeightsChunk; `data` is a view into the received message (keep it short-lived)."""

    offset: int
    data: memoryview
    crc32: int | None


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    """A request message that is not a valid UpdateWeightsRequest, and why."""

    reason: str


# ---- encoding (client) --------------------------------------------------------------------------


def encode_varint(value: int) -> bytes:
    """Protobuf's base-128 varint of an unsigned 64-bit value."""
    if not 0 <= value < _U64_LIMIT:
        raise ValueError(f"varint out of range: {value}")
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def crc32_of_pieces(pieces: Sequence[bytes | memoryview]) -> int:
    """CRC-32 of the concatenation of `pieces`, without concatenating them."""
    value = 0
    for piece in pieces:
        value = crc32(piece, value)
    return value


def encode_chunk(
    offset: int, pieces: Sequence[bytes | memoryview], crc32_value: int | None = None
) -> bytes:
    """UpdateWeightsRequest{chunk: {offset, data: b"".join(pieces), crc32}} as protobuf bytes.

    Byte for byte what SerializeToString writes: fields in number order, offset 0 and empty data
    left out (proto3 defaults), crc32 present whenever given (an explicit-presence field).
    """
    data_bytes = sum(len(piece) for piece in pieces)
    head = bytearray()
    if offset:
        head.append(_CHUNK_OFFSET)
        head += encode_varint(offset)
    if data_bytes:
        head.append(_CHUNK_DATA)
        head += encode_varint(data_bytes)
    tail = b""
    if crc32_value is not None:
        tail = bytes([_CHUNK_CRC32]) + crc32_value.to_bytes(4, "little")
    inner_bytes = len(head) + data_bytes + len(tail)
    prefix = bytes([_REQUEST_CHUNK]) + encode_varint(inner_bytes) + head
    return b"".join([prefix, *pieces, tail])  # the one copy of the payload


def encode_at_once(messages: Iterable[bytes]) -> bytes:
    """UpdateWeightsAtOnceRequest{messages: [...]} of already encoded UpdateWeightsRequests,
    byte for byte what SerializeToString writes."""
    out = bytearray()
    for message in messages:
        out.append(_AT_ONCE_MESSAGE)
        out += encode_varint(len(message))
        out += message
    return bytes(out)


def update_weights_callable(
    channel: grpc.Channel | grpc.aio.Channel,
) -> grpc.StreamUnaryMultiCallable | grpc.aio.StreamUnaryMultiCallable:
    """Rollout.UpdateWeights on `channel`, taking already encoded request messages (bytes).

    A sync channel gives a sync callable (an iterator of bytes); a grpc.aio channel gives an
    awaitable one (a sync or async iterator of bytes).
    """
    # request_serializer=None: gRPC sends each bytes object as it is (it still copies it once
    # into its own buffer; grpcio 1.85 accepts only bytes there, not memoryviews).
    return channel.stream_unary(
        UPDATE_WEIGHTS_METHOD,
        request_serializer=None,
        response_deserializer=pb.UpdateWeightsResponse.FromString,
    )


def update_weights_at_once_callable(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    """Rollout.UpdateWeightsAtOnce on a sync `channel`, taking `encode_at_once` bytes."""
    return channel.unary_unary(
        UPDATE_WEIGHTS_AT_ONCE_METHOD,
        request_serializer=None,
        response_deserializer=pb.UpdateWeightsResponse.FromString,
    )


# ---- decoding (server) --------------------------------------------------------------------------


class _Malformed(Exception):
    """Internal: unwinds the parser; surfaces as a MalformedRequest, never to gRPC."""


def _read_varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for index in range(pos, min(end, pos + _MAX_VARINT_BYTES)):
        byte = view[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value >= _U64_LIMIT:
                raise _Malformed("varint out of the 64-bit range")
            return value, index + 1
        shift += 7
    raise _Malformed("truncated or overlong varint")


def _read_length(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    length, pos = _read_varint(view, pos, end)
    if length > end - pos:
        raise _Malformed(f"a length-delimited field of {length} bytes runs past the message")
    return length, pos


def _parse_chunk(view: memoryview, pos: int, end: int) -> WireChunk:
    offset: int | None = None
    data: memoryview | None = None
    crc32_value: int | None = None
    while pos < end:
        tag, pos = _read_varint(view, pos, end)
        if tag == _CHUNK_DATA and data is None:
            length, pos = _read_length(view, pos, end)
            data, pos = view[pos : pos + length], pos + length
        elif tag == _CHUNK_OFFSET and offset is None:
            offset, pos = _read_varint(view, pos, end)
        elif tag == _CHUNK_CRC32 and crc32_value is None:
            if end - pos < 4:
                raise _Malformed("truncated crc32")
            crc32_value, pos = int.from_bytes(view[pos : pos + 4], "little"), pos + 4
        elif tag in (_CHUNK_DATA, _CHUNK_OFFSET, _CHUNK_CRC32):
            raise _Malformed(f"WeightsChunk field {tag >> 3} appears twice")
        else:
            raise _Malformed(
                f"WeightsChunk field {tag >> 3} (wire type {tag & 7}) is unknown to this server"
            )
    return WireChunk(offset or 0, data if data is not None else view[0:0], crc32_value)


def parse_update_request(
    message: bytes | memoryview,
) -> pb.UpdateWeightsRequest | WireChunk | MalformedRequest:
    """One received UpdateWeightsRequest: a header or shm_written (protobuf), a WireChunk, or why
    it is none of them.

    Use as the request_deserializer of UpdateWeights on the server. Never raises.
    """
    view = memoryview(message)
    end = len(view)
    field = "WeightsHeader"
    try:
        if end == 0:
            raise _Malformed("an empty UpdateWeightsRequest (neither header nor chunk)")
        tag, pos = _read_varint(view, 0, end)
        if tag not in (_REQUEST_HEADER, _REQUEST_CHUNK, _REQUEST_SHM_WRITTEN):
            raise _Malformed(
                f"UpdateWeightsRequest field {tag >> 3} (wire type {tag & 7}) is unknown to this "
                "server"
            )
        length, pos = _read_length(view, pos, end)
        if pos + length != end:
            raise _Malformed(
                "an UpdateWeightsRequest must hold exactly one header, chunk or shm_written"
            )
        if tag == _REQUEST_CHUNK:
            return _parse_chunk(view, pos, end)
        if tag == _REQUEST_SHM_WRITTEN:
            field = "SharedMemoryWritten"
        return pb.UpdateWeightsRequest.FromString(message)  # small: protobuf's own parser
    except _Malformed as error:
        return MalformedRequest(str(error))
    except Exception as error:  # protobuf's DecodeError on a malformed header
        return MalformedRequest(f"the {field} does not parse: {error}")


def parse_update_at_once(message: bytes) -> AtOnceMessages:
    """A received UpdateWeightsAtOnceRequest, to be parsed as it is read (AtOnceMessages).

    Use as the request_deserializer of UpdateWeightsAtOnce on the server. Never raises.
    """
    return AtOnceMessages(message)


@dataclass(frozen=True, slots=True)
class AtOnceMessages:
    """The messages of an UpdateWeightsAtOnceRequest, each parsed as `parse_update_request`
    parses a stream's, one at a time as the update reads them: a request that is many tiny
    messages costs no more than a stream of them (no list of them all, and an update that
    fails stops the parse). Bytes that are no list of messages end it with a MalformedRequest,
    which fails the update as on a stream. Falsy for a request with no message."""

    data: bytes

    def __bool__(self) -> bool:
        return len(self.data) > 0

    def __iter__(self) -> Iterator[pb.UpdateWeightsRequest | WireChunk | MalformedRequest]:
        view = memoryview(self.data)
        end, pos = len(view), 0
        try:
            while pos < end:
                tag, pos = _read_varint(view, pos, end)
                if tag != _AT_ONCE_MESSAGE:
                    raise _Malformed(
                        f"UpdateWeightsAtOnceRequest field {tag >> 3} (wire type {tag & 7}) is "
                        "unknown to this server"
                    )
                length, pos = _read_length(view, pos, end)
                # A view: a chunk's data stays in the bytes gRPC received, as on a stream.
                yield parse_update_request(view[pos : pos + length])
                pos += length
        except _Malformed as error:
            yield MalformedRequest(str(error))
