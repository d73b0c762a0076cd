"""Servicing one Subscribe call: check the first request, join the dealer's ring, yield dealt
batches, and read the acknowledgements that follow.

The servicer's Subscribe method is glue around `serve_subscribe`; the call leaves the ring when
it ends (client gone, deadline, max_batches reached) through `Subscription.cancel` (dealer.py).

Subscribe is a bidirectional stream. The first request opens the subscription; with a window
(SubscribeRequest.window >= 1) every later request acknowledges batches the trainer took, and a
daemon thread of the call reads them (the handler's own thread is busy sending, and waits on the
dealer alone, so the server's stop, a new batch and an acknowledgement all wake it the same way).
The thread ends with the call: gRPC ends the request stream of a call that is over. With window
0 (a client from before windows: one request, then its side closed) nothing more is read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import grpc

from ...client.protocol.errors import FailedPrecondition, InvalidArgument, RolloutError
from ...v1 import rollout_pb2 as pb
from .dealer import MAX_WINDOW, Subscription
from .loop import ContinuousRollout

__all__ = ["serve_subscribe", "subscriber_name"]

_LOG = logging.getLogger(__name__)
_MAX_SUBSCRIBER_ID_CHARS = 128  # it lands in log lines


def serve_subscribe(
    rollout: ContinuousRollout | None,
    requests: Iterator[pb.SubscribeRequest],
    context: grpc.ServicerContext,
) -> Iterator[pb.SubscribeResponse]:
    """The responses of one Subscribe call; errors are the domain errors of client/errors.py."""
    # Read first, as for a unary request: bytes that do not parse are INVALID_ARGUMENT anywhere.
    first = next(requests, None)
    if first is None:
        raise InvalidArgument("Subscribe: the client closed the call before its first request")
    if rollout is None:
        raise FailedPrecondition("this server runs no continuous rollout (--rollout-prompts)")
    window = _check_first(first)
    name = subscriber_name(first.subscriber_id, context.peer())
    subscription = rollout.subscribe(
        name, first.max_batches, context.is_active, window=window or None
    )
    if not context.add_callback(subscription.cancel):  # the call is already over
        subscription.cancel()
    if window:
        reader = threading.Thread(
            target=_read_acknowledgements,
            args=(requests, subscription),
            name="subscribe-acks",
            daemon=True,
        )
        reader.start()
    yield from subscription


def _check_first(request: pb.SubscribeRequest) -> int:
    """The window of a valid first request."""
    if request.max_batches < 0:
        raise InvalidArgument(f"max_batches: must be >= 0, got {request.max_batches}")
    if not 0 <= request.window <= MAX_WINDOW:
        raise InvalidArgument(
            f"window: must be 0 (no acknowledgements) to {MAX_WINDOW}, got {request.window}"
        )
    if request.taken:
        raise InvalidArgument("taken: the first request opens the subscription; acknowledge later")
    return request.window


def _read_acknowledgements(
    requests: Iterator[pb.SubscribeRequest], subscription: Subscription
) -> None:
    """Feed the later requests' acknowledgements to the dealer until the call ends."""
    try:
        for request in requests:
            if request.subscriber_id or request.max_batches or request.window:
                raise InvalidArgument(
                    "Subscribe: a later request only acknowledges (taken); subscriber_id, "
                    "max_batches and window belong to the first"
                )
            subscription.acknowledge(request.taken)
    except RolloutError as error:
        subscription.fail(error)
        return
    except grpc.RpcError:
        return  # the call is over (cancelled, deadline, or ended by the server)
    except Exception:  # noqa: BLE001 (the request stream's own abort, e.g. bytes that do not parse)
        _LOG.debug("Subscribe %s: the request stream failed", subscription.name, exc_info=True)
        subscription.fail(InvalidArgument("Subscribe: a later request could not be read"))
        return
    subscription.close_acknowledgements()


def subscriber_name(subscriber_id: str, peer: str) -> str:
    """The name a subscriber goes by in logs: its subscriber_id, else its peer address."""
    if len(subscriber_id) > _MAX_SUBSCRIBER_ID_CHARS or not subscriber_id.isprintable():
        raise InvalidArgument(
            f"subscriber_id: at most {_MAX_SUBSCRIBER_ID_CHARS} printable characters"
        )
    return subscriber_id or peer
