"""ServerCalls: one server's sync calls on the weights side, each with the client's deadline and
metadata.

The seam between a client and what sends its weights: `Uploads` starts UpdateWeights and asks
Health whether the server shares this host, `WeightsGroup` makes its members join and leave a
group and starts their UpdateWeights calls. Both clients (sync and asyncio) hand theirs out as
`weights_calls`; its calls are sync (an asyncio client runs them on a sync channel of its
settings, see AsyncRolloutClient._open_upload_channel).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ...v1 import rollout_pb2 as pb
from ...v1 import rollout_pb2_grpc
from ..protocol.errors import typed_errors
from ..protocol.wire import (
    encode_at_once,
    update_weights_at_once_callable,
    update_weights_callable,
)

__all__ = ["AT_ONCE_MAX_BYTES", "CallOptions", "ServerCalls"]

# The most bytes of messages sent as one UpdateWeightsAtOnce (a head of ~30,000 tensors); more go
# as a stream, whose chunks the server stages as they come.
AT_ONCE_MAX_BYTES = 4 << 20


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
    are the hand-encoded bytes of update_file.py. `send_small` and `start_small` send the few
    messages of an update whose data travel outside the call (cuda_ipc, dist) as one
    UpdateWeightsAtOnce where the server has it: a unary call costs the host about half of a
    stream's (bench/RESULTS.md, 2026-11-27).
    """

    def __init__(
        self,
        channel: grpc.Channel,
        options_for: OptionsFor,
        *,
        max_message_bytes: int = AT_ONCE_MAX_BYTES,
    ) -> None:
        # max_message_bytes: the channel's send limit; an at-once request stays under it.
        self.update_weights: Any = update_weights_callable(channel)
        self._update_at_once: Any = update_weights_at_once_callable(channel)
        self._stub = rollout_pb2_grpc.RolloutStub(channel)
        self.options_for = options_for
        self._at_once_max_bytes = min(AT_ONCE_MAX_BYTES, max_message_bytes)
        # False: every update as a stream (bench_update_latency.py's baseline).
        self.use_at_once = True
        # Whether the server has UpdateWeightsAtOnce: None until a probe got a clear answer.
        self._has_at_once: bool | None = None
        self._probe_lock = threading.Lock()

    def send_small(
        self, messages: Sequence[bytes], options: CallOptions
    ) -> pb.UpdateWeightsResponse:
        """UpdateWeights with these messages, as one UpdateWeightsAtOnce where it can be."""
        call, request = self._small_call(messages, options)
        return call(request, timeout=options.timeout_s, metadata=options.metadata)

    def start_small(
        self, messages: Sequence[bytes], timeout_s: float | None, request_id: str | None
    ) -> grpc.Future:
        """`send_small` as a grpc.Future of its reply."""
        options = self.options_for(timeout_s, request_id)
        call, request = self._small_call(messages, options)
        return call.future(request, timeout=options.timeout_s, metadata=options.metadata)

    def _small_call(self, messages: Sequence[bytes], options: CallOptions) -> tuple[Any, Any]:
        """UpdateWeightsAtOnce and its encoded request when it fits under the channel's limit
        and the server has the method, else UpdateWeights and the messages as a stream."""
        if self.use_at_once:
            request = encode_at_once(messages)
            if len(request) <= self._at_once_max_bytes and self._has_at_once_method(options):
                return self._update_at_once, request
        return self.update_weights, iter(messages)

    def _has_at_once_method(self, options: CallOptions) -> bool:
        """Whether the server has UpdateWeightsAtOnce, asked once with an empty request:
        INVALID_ARGUMENT from one that has it, UNIMPLEMENTED from an older one; any other
        answer is asked again next time (this update goes as a stream, which reports whatever
        is wrong)."""
        with self._probe_lock:
            if self._has_at_once is None:
                probe = self.options_for(options.timeout_s, None)  # not the update's request id
                try:
                    self._update_at_once(b"", timeout=probe.timeout_s, metadata=probe.metadata)
                except grpc.RpcError as error:
                    code = error.code()  # type: ignore[attr-defined]
                    if code == grpc.StatusCode.INVALID_ARGUMENT:
                        self._has_at_once = True
                    elif code == grpc.StatusCode.UNIMPLEMENTED:
                        self._has_at_once = False
            return bool(self._has_at_once)

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
