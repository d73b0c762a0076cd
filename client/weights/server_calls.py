"""ServerCalls: one server's sync calls on the weights side, each with the client's deadline and
metadata.

The seam between a client and what sends its weights: `Uploads` starts UpdateWeights and asks
Health whether the server shares this host, `WeightsGroup` makes its members join and leave a
group and starts their UpdateWeights calls. Both clients (sync and asyncio) hand theirs out as
`weights_calls`; its calls are sync (an asyncio client runs them on a sync channel of its
settings, see AsyncRolloutClient._open_upload_channel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from ...v1 import rollout_pb2 as pb
from ...v1 import rollout_pb2_grpc
from ..protocol.errors import typed_errors
from ..protocol.wire import update_weights_callable

__all__ = ["CallOptions", "ServerCalls"]


@dataclass(frozen=True)
class CallOptions:
    """The deadline and metadata of one call."""

    timeout_s: float
    metadata: tuple[tuple[str, str | bytes], ...]


# (timeout_s or None for the client's default, request_id or None) -> the call's options.
OptionsFor = Callable[[float | None, str | None], CallOptions]


class ServerCalls:
    """The weights-side RPCs of one server on `channel` (a sync channel).

    `update_weights` is UpdateWeights as a raw-bytes callable (protocol/wire.py): the messages
    are the hand-encoded bytes of update_file.py.
    """

    def __init__(self, channel: grpc.Channel, options_for: OptionsFor) -> None:
        self.update_weights: Any = update_weights_callable(channel)
        self._stub = rollout_pb2_grpc.RolloutStub(channel)
        self.options_for = options_for

    def health(self, timeout_s: float, *, wait_for_ready: bool = False) -> pb.HealthResponse:
        """Health, as gRPC raises it (Uploads asks it whether the server shares this host; a
        WeightsGroup waits with it for a server that is still loading). wait_for_ready: a
        server that is not listening yet is waited for (within timeout_s), not failed fast."""
        options = self.options_for(timeout_s, None)
        return self._stub.Health(
            pb.HealthRequest(),
            timeout=options.timeout_s,
            metadata=options.metadata,
            wait_for_ready=wait_for_ready,
        )

    def start_update(
        self, messages: Iterable[bytes], timeout_s: float | None, request_id: str | None
    ) -> grpc.Future:
        """UpdateWeights with these messages, as a grpc.Future of its reply."""
        options = self.options_for(timeout_s, request_id)
        return self.update_weights.future(
            messages, timeout=options.timeout_s, metadata=options.metadata
        )

    def init_weights_group(
        self, request: pb.InitWeightsGroupRequest, timeout_s: float
    ) -> pb.InitWeightsGroupResponse:
        """InitWeightsGroup: the server joins the group (blocks until every rank joined)."""
        options = self.options_for(timeout_s, None)
        with typed_errors():
            return self._stub.InitWeightsGroup(
                request, timeout=options.timeout_s, metadata=options.metadata
            )

    def start_init_weights_group(
        self, request: pb.InitWeightsGroupRequest, timeout_s: float
    ) -> grpc.Future:
        """InitWeightsGroup as a grpc.Future of its reply (it ends when every rank joined), so
        that a group whose formation failed elsewhere can cancel it."""
        options = self.options_for(timeout_s, None)
        return self._stub.InitWeightsGroup.future(
            request, timeout=options.timeout_s, metadata=options.metadata
        )

    def destroy_weights_group(self, group: str, timeout_s: float) -> None:
        """DestroyWeightsGroup: the server leaves the group."""
        options = self.options_for(timeout_s, None)
        with typed_errors():
            self._stub.DestroyWeightsGroup(
                pb.DestroyWeightsGroupRequest(group=group),
                timeout=options.timeout_s,
                metadata=options.metadata,
            )
