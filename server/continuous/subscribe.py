"""Servicing one Subscribe call: check the request, join the dealer's ring, yield dealt batches.

The servicer's Subscribe method is glue around `serve_subscribe`; the call leaves the ring when
it ends (client gone, deadline, max_batches reached) through `Subscription.cancel`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ...client.protocol.errors import FailedPrecondition, InvalidArgument
from ...v1 import rollout_pb2 as pb

if TYPE_CHECKING:
    import grpc

    from .dealer import Dealer
    from .loop import ContinuousRollout

__all__ = ["Subscription", "serve_subscribe", "subscriber_name"]

_MAX_SUBSCRIBER_ID_CHARS = 128  # it lands in log lines


class Subscription:
    """One Subscribe call: iterate it for the responses to send; `cancel()` when the call ends."""

    def __init__(
        self, dealer: Dealer, name: str, max_batches: int, is_live: Callable[[], bool]
    ) -> None:
        self.name = name
        self.remaining: int | None = max_batches or None  # None: until the rollout ends
        self.received = 0
        self.gone = False
        self.is_live = is_live
        self._dealer = dealer

    def __iter__(self) -> Iterator[pb.SubscribeResponse]:
        try:
            while (response := self._dealer.take(self)) is not None:
                yield response
        finally:
            self._dealer.leave(self)

    def cancel(self) -> None:
        """The call is over (client gone, deadline): leave the ring now; idempotent."""
        self._dealer.leave(self)


def serve_subscribe(
    rollout: ContinuousRollout | None, request: pb.SubscribeRequest, context: grpc.ServicerContext
) -> Iterator[pb.SubscribeResponse]:
    """The responses of one Subscribe call; errors are the domain errors of client/errors.py."""
    if rollout is None:
        raise FailedPrecondition("this server runs no continuous rollout (--rollout-prompts)")
    if request.max_batches < 0:
        raise InvalidArgument(f"max_batches: must be >= 0, got {request.max_batches}")
    name = subscriber_name(request.subscriber_id, context.peer())
    subscription = rollout.subscribe(name, request.max_batches, context.is_active)
    if not context.add_callback(subscription.cancel):  # the call is already over
        subscription.cancel()
    yield from subscription


def subscriber_name(subscriber_id: str, peer: str) -> str:
    """The name a subscriber goes by in logs: its subscriber_id, else its peer address."""
    if len(subscriber_id) > _MAX_SUBSCRIBER_ID_CHARS or not subscriber_id.isprintable():
        raise InvalidArgument(
            f"subscriber_id: at most {_MAX_SUBSCRIBER_ID_CHARS} printable characters"
        )
    return subscriber_id or peer
