"""RolloutClient: the synchronous trainer-side client of a rollserve server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import grpc
from rollserve.client.channel import DEFAULT_MAX_MESSAGE_BYTES, open_channel
from rollserve.client.errors import DeadlineExceeded, RolloutError, Unavailable, from_rpc_error
from rollserve.client.results import HealthStatus
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

__all__ = ["RolloutClient"]

T = TypeVar("T")


@contextmanager
def _typed_errors() -> Iterator[None]:
    """Turn grpc.RpcError into the shared exception table (rollserve.client.errors)."""
    try:
        yield
    except grpc.RpcError as error:
        raise from_rpc_error(error) from None


class RolloutClient:
    """A connection to one rollserve server.

    Every call has a deadline (`timeout_s`, defaulting to the client's). Errors are raised as
    the typed exceptions of `rollserve.client.errors`, carrying the gRPC status in `.code`.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._channel = open_channel(
            target, credentials=credentials, max_message_bytes=max_message_bytes
        )
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)

    def health(self, *, timeout_s: float | None = None) -> HealthStatus:
        """The server's readiness, model versions and load."""
        with _typed_errors():
            reply = self._stub.Health(pb.HealthRequest(), timeout=self._timeout(timeout_s))
        return HealthStatus.from_proto(reply)

    def wait_until_ready(self, timeout_s: float = 60.0, *, poll_s: float = 0.2) -> HealthStatus:
        """Block until the server reports SERVING; DeadlineExceeded after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        last: HealthStatus | RolloutError | None = None
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                last = self.health(timeout_s=min(remaining, 5.0))
                if last.serving:
                    return last
            except (Unavailable, DeadlineExceeded) as error:  # not listening yet, or loading
                last = error
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0)))
        raise DeadlineExceeded(f"{self.target} not SERVING after {timeout_s:.1f} s (last: {last})")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s
