"""UpdateWeightsAtOnce: an UpdateWeights stream's messages sent as one unary call.

The encoding against protobuf's in both directions and on malformed input; a real server that
takes a whole update (header and every chunk) in one call with every guarantee of the stream
(bit-exact, versioned, refusals that change nothing); and the client's choice: the small calls
of cuda_ipc and dist go at once to a server that has the method, and as a stream to an older
one that answers UNIMPLEMENTED (asked once).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from helpers_weights import (
    calls_checked,
    in_place_updates,
    perturbed,
    state_hash,
    update_weights_requests,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollserve.client.protocol.wire import (
    MalformedRequest,
    WireChunk,
    encode_at_once,
    encode_chunk,
    parse_update_at_once,
    parse_update_request,
    update_weights_at_once_callable,
)
from rollserve.client.weights.server_calls import AT_ONCE_MAX_BYTES, CallOptions, ServerCalls
from rollserve.client.weights.update_file import MIN_CHUNK_BYTES, update_weights_messages
from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelSet, load_models
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm
from rollserve.server.serving.app import RolloutServer
from rollserve.server.serving.handlers import add_rollout_servicer, rollout_method_handlers
from rollserve.server.serving.status import handles_errors
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

WAIT_S = 30.0
OPTIONS = CallOptions(timeout_s=WAIT_S, metadata=())
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADER = pb.UpdateWeightsRequest(header=pb.WeightsHeader(version=3, total_bytes=100))


# ---- the encoding -------------------------------------------------------------------------------


@FAST
@given(
    chunks=st.lists(
        st.tuples(st.integers(0, 2**40), st.binary(max_size=300)), min_size=0, max_size=5
    )
)
def test_the_encoding_is_protobufs_in_both_directions(chunks: list[tuple[int, bytes]]) -> None:
    messages = [HEADER.SerializeToString(), *(encode_chunk(o, [d]) for o, d in chunks)]
    encoded = encode_at_once(messages)
    as_protobuf = pb.UpdateWeightsAtOnceRequest(
        messages=[pb.UpdateWeightsRequest.FromString(m) for m in messages]
    )
    assert encoded == as_protobuf.SerializeToString()
    parsed = list(parse_update_at_once(as_protobuf.SerializeToString()))
    assert parsed[0] == HEADER
    assert [(c.offset, bytes(c.data)) for c in parsed[1:]] == chunks
    assert all(type(c) is WireChunk for c in parsed[1:])


def test_an_empty_request_is_no_message() -> None:
    assert encode_at_once([]) == b""
    assert not parse_update_at_once(b"") and list(parse_update_at_once(b"")) == []
    one_empty_message = parse_update_at_once(b"\x0a\x00")
    assert one_empty_message and isinstance(list(one_empty_message)[0], MalformedRequest)


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (b"\x12\x00", "field 2"),  # not the repeated field
        (b"\x08\x01", "field 1 (wire type 0)"),
        (b"\x0a\x05\x0a\x00", "runs past"),  # a length past the end
        (b"\x0a", "varint"),  # truncated
    ],
)
def test_a_request_that_is_no_list_of_messages_is_one_malformed_request(
    message: bytes, reason: str
) -> None:
    parsed = list(parse_update_at_once(message))
    assert len(parsed) == 1 and isinstance(parsed[0], MalformedRequest)
    assert reason in parsed[0].reason


def test_each_message_is_parsed_as_a_streams_would_be_and_as_it_is_read() -> None:
    bad_chunk = b"\x12\x02\x20\x01"  # a WeightsChunk field this server does not know
    parsed = list(parse_update_at_once(encode_at_once([HEADER.SerializeToString(), bad_chunk])))
    assert parsed == [HEADER, parse_update_request(bad_chunk)]
    assert isinstance(parsed[1], MalformedRequest)
    # Good messages come before the bytes that are none: read one at a time, never all first.
    good_then_garbage = parse_update_at_once(encode_at_once([HEADER.SerializeToString()]) + b"\xff")
    messages = iter(good_then_garbage)
    assert next(messages) == HEADER
    assert isinstance(next(messages), MalformedRequest)
    assert next(messages, None) is None


@FAST
@given(st.binary(max_size=64))
def test_random_bytes_never_raise(message: bytes) -> None:
    for item in parse_update_at_once(message):
        assert isinstance(item, (WireChunk, MalformedRequest, pb.UpdateWeightsRequest))


def test_the_server_parses_the_method_by_hand() -> None:
    handler = rollout_method_handlers(rollout_pb2_grpc.RolloutServicer())["UpdateWeightsAtOnce"]
    assert handler.request_deserializer is parse_update_at_once
    assert not handler.request_streaming and not handler.response_streaming


# ---- a real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> ModelSet:
    actor: Path = save_tiny_causal_lm(tmp_path_factory.mktemp("at-once-actor"), TinyModelSpec())
    return load_models(ServerConfig(device="cpu", actor=str(actor)))


@pytest.fixture
def channel(models: ModelSet) -> Iterator[grpc.Channel]:
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", metrics_port=0)
    with RolloutServer(config, models=models) as server:
        with grpc.insecure_channel(server.address) as opened:
            yield opened


def at_once(messages: list[pb.UpdateWeightsRequest]) -> pb.UpdateWeightsAtOnceRequest:
    return pb.UpdateWeightsAtOnceRequest(messages=messages)


def refusal(call: grpc.UnaryUnaryMultiCallable, request: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=WAIT_S)
    return caught.value


def test_a_whole_update_in_one_call_lands_bit_exact_and_versioned(
    models: ModelSet, channel: grpc.Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = calls_checked(monkeypatch)  # the update is handed its call
    stub = rollout_pb2_grpc.RolloutStub(channel)
    actor = models.actor.module
    weights = perturbed(actor, seed=1)
    messages = list(
        update_weights_requests(
            weights, target="actor", version=1, mode="full", chunk_bytes=MIN_CHUNK_BYTES
        )
    )
    assert len(messages) > 2  # a header and several chunks
    reply = stub.UpdateWeightsAtOnce(at_once(messages), timeout=WAIT_S)
    assert (reply.version, reply.transport, reply.tensors) == (1, "grpc", len(weights))
    assert all(torch.equal(actor.state_dict()[name], t) for name, t in weights.items())
    assert stub.Health(pb.HealthRequest(), timeout=WAIT_S).policy_version == 1
    (call,) = calls
    assert (
        isinstance(call, grpc.ServicerContext) and 0 < call.time_remaining() <= WAIT_S + 1
    )  # sent rounded up


def test_refused_calls_change_nothing(models: ModelSet, channel: grpc.Channel) -> None:
    stub = rollout_pb2_grpc.RolloutStub(channel)
    actor = models.actor.module
    version = stub.Health(pb.HealthRequest(), timeout=WAIT_S).policy_version + 1
    first = list(update_weights_requests(perturbed(actor, seed=2), version=version, mode="full"))
    stub.UpdateWeightsAtOnce(at_once(first), timeout=WAIT_S)
    before = state_hash(actor)
    weights = perturbed(actor, seed=3)
    full = list(
        update_weights_requests(
            weights, version=version + 1, mode="full", chunk_bytes=MIN_CHUNK_BYTES
        )
    )
    stale = list(update_weights_requests(weights, version=version, mode="full"))
    cases = [
        (pb.UpdateWeightsAtOnceRequest(), grpc.StatusCode.INVALID_ARGUMENT, "no message"),
        (at_once(full[1:]), grpc.StatusCode.INVALID_ARGUMENT, "must be a header"),
        (at_once(full[:-1]), grpc.StatusCode.INVALID_ARGUMENT, "bytes"),  # cut short
        (at_once(stale), grpc.StatusCode.FAILED_PRECONDITION, "not above"),
    ]
    for request, code, words in cases:
        error = refusal(stub.UpdateWeightsAtOnce, request)
        assert (error.code(), words in error.details()) == (code, True), error.details()
    raw = update_weights_at_once_callable(channel)  # bytes that are no list of messages
    error = refusal(raw, b"\x12\x00")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in error.details()
    assert state_hash(actor) == before
    assert stub.Health(pb.HealthRequest(), timeout=WAIT_S).policy_version == version


# ---- the client's choice ------------------------------------------------------------------------


class OlderServer(rollout_pb2_grpc.RolloutServicer):
    """A server from before UpdateWeightsAtOnce (the generated base answers UNIMPLEMENTED),
    whose UpdateWeights stages into a real module."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.updates = in_place_updates(model)
        self.at_once_calls = 0
        self.streams = 0

    @handles_errors
    def UpdateWeights(self, request_iterator, context):  # noqa: N802 (gRPC's name)
        self.streams += 1
        return self.updates.update(request_iterator)

    def UpdateWeightsAtOnce(self, request, context):  # noqa: N802
        self.at_once_calls += 1
        return super().UpdateWeightsAtOnce(request, context)


@pytest.fixture
def older_server() -> Iterator[tuple[OlderServer, grpc.Channel]]:
    torch.manual_seed(1)
    servicer = OlderServer(torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.LayerNorm(40)))
    server = grpc.server(futures.ThreadPoolExecutor(2))
    add_rollout_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield servicer, channel
    server.stop(None)


def shifted(model: torch.nn.Module, version: int) -> dict[str, torch.Tensor]:
    return {name: tensor + version for name, tensor in model.state_dict().items()}


def test_an_older_server_gets_streams_after_one_probe(older_server) -> None:
    servicer, channel = older_server
    calls = ServerCalls(channel, lambda timeout_s, request_id: OPTIONS)
    for version in (1, 2):
        weights = shifted(servicer.model, version)
        messages = list(update_weights_messages(weights, version=version, mode="full"))
        if version == 1:
            reply = calls.send_small(messages, OPTIONS)
        else:
            reply = calls.start_small(messages, WAIT_S, None).result()
        assert reply.version == version
        assert all(torch.equal(servicer.model.state_dict()[k], t) for k, t in weights.items())
    assert (servicer.at_once_calls, servicer.streams) == (1, 2)


def test_messages_over_the_channels_limit_go_as_a_stream_unasked(older_server) -> None:
    servicer, channel = older_server
    messages = list(update_weights_messages(shifted(servicer.model, 1), version=1, mode="full"))
    # A client whose channel sends smaller messages than one request of these would be.
    limit = len(encode_at_once(messages)) - 1
    calls = ServerCalls(channel, lambda timeout_s, request_id: OPTIONS, max_message_bytes=limit)
    assert calls.send_small(messages, OPTIONS).version == 1
    assert (servicer.at_once_calls, servicer.streams) == (0, 1)


def test_the_bound_holds_the_head_of_a_large_model() -> None:
    # ~100 bytes of header JSON a tensor: a head of 30,000 tensors fits.
    assert AT_ONCE_MAX_BYTES >= 30_000 * 100 + MIN_CHUNK_BYTES
