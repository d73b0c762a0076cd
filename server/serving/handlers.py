"""Registering the Rollout servicer on a grpc.Server with the wire fast path for UpdateWeights.

Like the generated `rollout_pb2_grpc.add_RolloutServicer_to_server`, for every method of the
rollserve.v1.Rollout service in the descriptor, except that UpdateWeights requests are parsed
by `protocol.wire.parse_update_request` (UpdateWeightsAtOnce's by `parse_update_at_once`, a list
of them): a chunk's data stays a view into the bytes gRPC
received instead of being copied into a protobuf message and copied out again on `.data`.
The stream consumer (server/weights/staging.py) takes both forms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor

from ...client.protocol.wire import parse_update_at_once, parse_update_request
from ...v1 import rollout_pb2 as pb

__all__ = ["ROLLOUT_SERVICE", "add_rollout_servicer", "rollout_method_handlers"]

_SERVICE = pb.DESCRIPTOR.services_by_name["Rollout"]
ROLLOUT_SERVICE = _SERVICE.full_name  # "rollserve.v1.Rollout"
# Methods whose requests skip protobuf: name -> request_deserializer.
_WIRE_DESERIALIZERS: Mapping[str, Callable[[bytes], Any]] = {
    "UpdateWeights": parse_update_request,
    "UpdateWeightsAtOnce": parse_update_at_once,
}


def _handler(method: MethodDescriptor, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    deserializer = _WIRE_DESERIALIZERS.get(method.name, request_class.FromString)
    serializer = response_class.SerializeToString
    if method.client_streaming and method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, deserializer, serializer)
    if method.client_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, deserializer, serializer)
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(behavior, deserializer, serializer)


def rollout_method_handlers(servicer: object) -> dict[str, grpc.RpcMethodHandler]:
    """Method name -> handler for every method of the service, bound to `servicer`."""
    return {
        method.name: _handler(method, getattr(servicer, method.name)) for method in _SERVICE.methods
    }


def add_rollout_servicer(servicer: object, server: grpc.Server) -> None:
    """Register `servicer` (a RolloutServicer) on `server`; use instead of the generated one."""
    handlers = rollout_method_handlers(servicer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(ROLLOUT_SERVICE, handlers),)
    )
    # As the generated code does: lets grpc dispatch these methods without a generic lookup.
    server.add_registered_method_handlers(ROLLOUT_SERVICE, handlers)
