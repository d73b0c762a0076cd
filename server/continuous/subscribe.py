"""Servicing one Subscribe call: check the request, join the dealer's ring, yield dealt batches.

The servicer's Subscribe method is glue around `serve_subscribe`; the call leaves the ring when
it ends (client gone, deadline, max_batches reached) through `Subscription.cancel` (dealer.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ...client.protocol.errors import FailedPrecondition, InvalidArgument
from ...v1 import rollout_pb2 as pb
from .loop import ContinuousRollout

if TYPE_CHECKING:
    import grpc

__all__ = ["serve_subscribe", "subscriber_name"]

_MAX_SUBSCRIBER_ID_CHARS = 128  # it lands in log lines


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
