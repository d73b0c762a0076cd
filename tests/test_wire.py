"""The hand-written UpdateWeights wire path (client/wire.py, server/handlers.py) against the
protobuf runtime in both directions, on malformed input, and over real gRPC into real staging."""

from __future__ import annotations

import copy
import hashlib
import zlib
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch
from helpers_weights import in_place_updates, update_in_place, update_weights_requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.client.protocol.wire import (
    MalformedRequest,
    WireChunk,
    crc32,
    crc32_of_pieces,
    encode_chunk,
    encode_varint,
    parse_update_request,
    update_weights_callable,
)
from rollserve.client.weights.update_file import (
    MIN_CHUNK_BYTES,
    iter_chunk_pieces,
    iter_safetensors_bytes,
    update_weights_messages,
)
from rollserve.server.serving.handlers import (
    ROLLOUT_SERVICE,
    add_rollout_servicer,
    rollout_method_handlers,
)
from rollserve.server.serving.status import handles_errors
from rollserve.server.weights import read_header
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

U64 = st.integers(min_value=0, max_value=2**64 - 1)
# Sizes around the varint boundaries, 0, and over 2**21 (a three-byte length varint's limit).
SIZES = st.one_of(
    st.sampled_from([0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**21 + 5]),
    st.integers(min_value=0, max_value=4096),
)
CRCS = st.one_of(st.none(), st.integers(min_value=0, max_value=2**32 - 1))
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def payload(size: int, seed: int) -> bytes:
    return bytes((seed + 7 * i) & 0xFF for i in range(min(size, 256))) * (size // 256) + bytes(
        (seed + 7 * i) & 0xFF for i in range(size % 256)
    )


def split(data: bytes, cuts: list[int]) -> list[memoryview]:
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    view = memoryview(data)
    return [view[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def protobuf_chunk(offset: int, data: bytes, crc: int | None) -> pb.UpdateWeightsRequest:
    chunk = pb.WeightsChunk(offset=offset, data=data)
    if crc is not None:
        chunk.crc32 = crc
    return pb.UpdateWeightsRequest(chunk=chunk)


# ---- both directions against protobuf ---------------------------------------------------------


@FAST
@given(offset=U64, size=SIZES, crc=CRCS, seed=st.integers(0, 255), cuts=st.lists(U64, max_size=4))
def test_hand_encoding_is_what_protobuf_writes_and_reads(
    offset: int, size: int, crc: int | None, seed: int, cuts: list[int]
) -> None:
    data = payload(size, seed)
    encoded = encode_chunk(offset, split(data, cuts), crc)
    assert encoded == protobuf_chunk(offset, data, crc).SerializeToString()
    parsed = pb.UpdateWeightsRequest.FromString(encoded)
    assert parsed.WhichOneof("payload") == "chunk"
    assert (parsed.chunk.offset, parsed.chunk.data) == (offset, data)
    assert parsed.chunk.HasField("crc32") == (crc is not None)
    assert crc is None or parsed.chunk.crc32 == crc


@FAST
@given(offset=U64, size=SIZES, crc=CRCS, seed=st.integers(0, 255))
def test_hand_parser_reads_what_protobuf_writes(
    offset: int, size: int, crc: int | None, seed: int
) -> None:
    data = payload(size, seed)
    message = protobuf_chunk(offset, data, crc).SerializeToString()
    parsed = parse_update_request(message)
    assert type(parsed) is WireChunk
    assert (parsed.offset, bytes(parsed.data), parsed.crc32) == (offset, data, crc)
    if size:
        assert parsed.data.obj is message  # a view into the received bytes, not a copy


def test_fields_in_any_order_and_non_minimal_varints_parse() -> None:
    inner = b"\x1d" + (7).to_bytes(4, "little") + b"\x12\x03abc" + b"\x08\x85\x80\x00"  # 5
    parsed = parse_update_request(b"\x12" + encode_varint(len(inner)) + inner)
    assert type(parsed) is WireChunk
    assert (parsed.offset, bytes(parsed.data), parsed.crc32) == (5, b"abc", 7)
    empty = parse_update_request(b"\x12\x00")  # a chunk with every field at its default
    assert type(empty) is WireChunk and (empty.offset, bytes(empty.data), empty.crc32) == (
        0,
        b"",
        None,
    )


def test_header_messages_go_through_protobuf() -> None:
    header = pb.WeightsHeader(version=3, total_bytes=99, sha256="ab" * 32, allow_non_finite=True)
    header.manifest.add(name="w", dtype=pb.DTYPE_FLOAT32, shape=[2, 3])
    parsed = parse_update_request(pb.UpdateWeightsRequest(header=header).SerializeToString())
    assert isinstance(parsed, pb.UpdateWeightsRequest) and parsed.header == header


def test_crc_of_pieces_is_zlib_crc_of_the_whole() -> None:
    data = payload(300_000, 3)
    assert crc32_of_pieces(split(data, [5, 77_000, 200_001])) == zlib.crc32(data) == crc32(data)
    assert crc32_of_pieces([]) == zlib.crc32(b"")


# ---- malformed input: a MalformedRequest, never an exception ----------------------------------

GOOD_CHUNK = protobuf_chunk(1 << 20, b"xyz" * 5, 0xDEADBEEF).SerializeToString()
GOOD_HEADER = pb.UpdateWeightsRequest(header=pb.WeightsHeader(version=1)).SerializeToString()


def test_shm_written_parses_with_protobuf() -> None:
    message = pb.UpdateWeightsRequest(shm_written=pb.SharedMemoryWritten(bytes=12345))
    parsed = parse_update_request(message.SerializeToString())
    assert isinstance(parsed, pb.UpdateWeightsRequest) and parsed.shm_written.bytes == 12345
    broken = parse_update_request(b"\x1a\x02\x08\x80")  # a truncated varint inside
    assert isinstance(broken, MalformedRequest)
    assert "SharedMemoryWritten does not parse" in broken.reason


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (b"", "empty"),
        (b"\x22\x00", "field 4"),  # an UpdateWeightsRequest field this server does not know
        (b"\x10\x01", "field 2 (wire type 0)"),  # chunk with the wrong wire type
        (b"\x12\x02\x20\x01", "WeightsChunk field 4"),  # unknown field inside the chunk
        (b"\x12\x06\x08\x01\x08\x02\x12\x00", "twice"),  # repeated offset
        (b"\x12\x04\x12\x00\x12\x00", "twice"),  # repeated data
        (b"\x12\x05\x12\x09abc", "runs past"),  # data longer than the chunk
        (b"\x12\x09\x12\x09abc", "runs past"),  # chunk longer than the message
        (b"\x12\x03\x1d\x01\x02", "truncated crc32"),
        (b"\x12\x02\x08\x80", "varint"),  # truncated varint
        (b"\x12\x0b\x08" + b"\xff" * 10, "varint"),  # overlong varint
        (b"\x12\x0b\x08" + b"\xff" * 9 + b"\x02", "64-bit"),  # 2**64 and above
        (GOOD_CHUNK + GOOD_CHUNK, "exactly one"),
        (GOOD_HEADER + GOOD_CHUNK, "exactly one"),
        (b"\x0a\x02\x10\x80", "WeightsHeader does not parse"),  # header with a truncated varint
    ],
)
def test_malformed_messages_are_described(message: bytes, reason: str) -> None:
    parsed = parse_update_request(message)
    assert isinstance(parsed, MalformedRequest) and reason in parsed.reason


@FAST
@given(st.binary(max_size=64))
def test_random_bytes_never_raise(message: bytes) -> None:
    parsed = parse_update_request(message)
    assert isinstance(parsed, (WireChunk, MalformedRequest, pb.UpdateWeightsRequest))


@FAST
@given(position=st.integers(0, len(GOOD_CHUNK) - 1), byte=st.integers(0, 255))
def test_corrupted_chunks_parse_consistently_or_are_refused(position: int, byte: int) -> None:
    message = bytearray(GOOD_CHUNK)
    message[position] = byte
    parsed = parse_update_request(bytes(message))
    if type(parsed) is WireChunk:  # whatever parses by hand must parse the same in protobuf
        reference = pb.UpdateWeightsRequest.FromString(bytes(message)).chunk
        assert (parsed.offset, bytes(parsed.data)) == (reference.offset, reference.data)
        assert parsed.crc32 == (reference.crc32 if reference.HasField("crc32") else None)
    else:
        assert isinstance(parsed, (MalformedRequest, pb.UpdateWeightsRequest))


# ---- the client's encoded stream equals the protobuf stream -----------------------------------


def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(300, 600)  # 720,000 bytes: chunks span tensor boundaries
    return {
        "w": base,
        "t": base.T,  # non-contiguous: a temporary host copy
        "h": torch.randn(1000).half(),
        "steps": torch.tensor(3),
        "empty": torch.zeros(0, 2),
        "flags": torch.tensor([True, False]),
    }


@pytest.mark.parametrize("crc", [True, False])
def test_encoded_messages_equal_what_protobuf_writes_for_the_stream(crc: bool) -> None:
    options = dict(target="critic", version=4, mode="partial", chunk_bytes=MIN_CHUNK_BYTES)
    seen: list[tuple[int, int]] = []
    messages = list(
        update_weights_messages(
            tensors(), crc32=crc, sha256=True, progress=lambda *p: seen.append(p), **options
        )
    )
    # The reference: protobuf's own serializer over the file, cut at the same offsets.
    header = pb.UpdateWeightsRequest.FromString(messages[0]).header
    blob = b"".join(iter_safetensors_bytes(tensors(), MIN_CHUNK_BYTES))
    offsets = range(0, len(blob), MIN_CHUNK_BYTES)
    pieces = [blob[offset : offset + MIN_CHUNK_BYTES] for offset in offsets]
    expected = [
        protobuf_chunk(offset, piece, zlib.crc32(piece) if crc else None).SerializeToString()
        for offset, piece in zip(offsets, pieces, strict=True)
    ]
    assert header.target == pb.MODEL_ROLE_CRITIC and header.mode == pb.UPDATE_MODE_PARTIAL
    assert header.version == 4 and header.total_bytes == len(blob)
    assert header.sha256 == hashlib.sha256(blob).hexdigest()
    assert len(expected) > 2 and messages[1:] == expected
    total = header.total_bytes
    assert seen[0] == (0, total) and seen[-1] == (total, total) and len(seen) == len(messages)


def test_chunk_pieces_keep_no_view_of_a_temporary_copy_past_its_turn() -> None:
    state_dict = tensors()
    caller = [
        (t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in state_dict.values()
    ]
    held = 0
    for pieces in iter_chunk_pieces(state_dict, 100_000):
        # Every piece but the last belongs to an earlier tensor: a view must read the caller's
        # memory (or the header bytes), never a host copy made for an earlier tensor.
        for piece in pieces[:-1]:
            if isinstance(piece, memoryview) and not isinstance(piece.obj, bytes):
                address = piece.obj.__array_interface__["data"][0]
                assert any(begin <= address < end for begin, end in caller)
                held += 1
    assert held  # the contiguous tensors' tails are kept as views, not copied


# ---- the server's registration and real gRPC into real staging --------------------------------


def test_handlers_cover_every_method_and_parse_update_weights_by_hand() -> None:
    handlers = rollout_method_handlers(rollout_pb2_grpc.RolloutServicer())
    methods = pb.DESCRIPTOR.services_by_name["Rollout"].methods
    assert sorted(handlers) == sorted(m.name for m in methods)
    assert ROLLOUT_SERVICE == "rollserve.v1.Rollout"
    assert handlers["UpdateWeights"].request_deserializer is parse_update_request
    assert handlers["UpdateWeights"].request_streaming
    health = handlers["Health"].request_deserializer
    assert health(pb.HealthRequest().SerializeToString()) == pb.HealthRequest()


class StagingServicer(rollout_pb2_grpc.RolloutServicer):
    """UpdateWeights through the server's update path into a real module (no engine)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.seen: list[type] = []
        self.updates = in_place_updates(model)

    @handles_errors
    def UpdateWeights(self, request_iterator, context):  # noqa: N802 (gRPC's name)
        return self.updates.update(self.seen.append(type(r)) or r for r in request_iterator)


@pytest.fixture()
def wire_server() -> Iterator[tuple[StagingServicer, grpc.Channel]]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(300, 400), torch.nn.LayerNorm(400))
    servicer = StagingServicer(model)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    add_rollout_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, channel
    channel.close()
    server.stop(None)


def test_encoded_update_over_grpc_applies_bit_exact(wire_server) -> None:
    servicer, channel = wire_server
    torch.manual_seed(2)
    sender = copy.deepcopy(servicer.model)
    with torch.no_grad():
        for parameter in sender.parameters():
            parameter.add_(torch.randn_like(parameter))
    messages = update_weights_messages(
        sender, target="actor", version=7, mode="full", chunk_bytes=MIN_CHUNK_BYTES, sha256=True
    )
    reply = update_weights_callable(channel)(messages, timeout=30)
    assert reply.version == 7
    for name, tensor in sender.state_dict().items():
        assert torch.equal(servicer.model.state_dict()[name], tensor), name
    assert servicer.seen[0] is pb.UpdateWeightsRequest and set(servicer.seen[1:]) == {WireChunk}


def test_protobuf_clients_still_work_through_the_wire_parser(wire_server) -> None:
    servicer, channel = wire_server
    sender = {k: v + 1 for k, v in servicer.model.state_dict().items()}
    requests = update_weights_requests(sender, target="actor", version=8, mode="full")
    reply = rollout_pb2_grpc.RolloutStub(channel).UpdateWeights(requests, timeout=30)
    assert reply.version == 8
    for name, tensor in sender.items():
        assert torch.equal(servicer.model.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda m: [m[0], b"\x12\x02\x20\x01", *m[1:]], "WeightsChunk field 4"),
        (lambda m: [b"\x22\x00", *m], "malformed UpdateWeightsRequest"),
        (lambda m: [m[0], m[1][:-1] + bytes([m[1][-1] ^ 1]), *m[2:]], "crc32 mismatch"),
    ],
)
def test_malformed_or_corrupt_messages_are_invalid_argument(wire_server, corrupt, match) -> None:
    servicer, channel = wire_server
    before = {k: v.clone() for k, v in servicer.model.state_dict().items()}
    sender = {k: v * 2 for k, v in before.items()}
    messages = list(
        update_weights_messages(sender, target="actor", version=9, mode="full", crc32=True)
    )
    with pytest.raises(grpc.RpcError) as caught:
        update_weights_callable(channel)(iter(corrupt(messages)), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in caught.value.details()
    for name, tensor in before.items():  # nothing was applied
        assert torch.equal(servicer.model.state_dict()[name], tensor), name


def test_in_process_streams_of_parsed_messages_stage_like_protobuf_ones() -> None:
    torch.manual_seed(3)
    model = torch.nn.Linear(64, 32)
    sender = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    messages = update_weights_messages(sender, target="actor", version=2, mode="full")
    update_in_place(model, map(parse_update_request, messages))
    for name, tensor in sender.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    with pytest.raises(InvalidArgument, match="first UpdateWeights message must be a header"):
        read_header(iter([parse_update_request(b"\x12\x00")]))
