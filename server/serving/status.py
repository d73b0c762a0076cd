"""The one place that turns exceptions into gRPC statuses (DESIGN.md section 6).

Servicer methods are decorated with `@handles_errors`. A `RolloutError` travels as its own code
and message; anything else is a bug and travels as INTERNAL with a generic message, while the
traceback goes to the server log only (no stack traces or internal names on the wire).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc

from ...client.protocol.errors import Cancelled, Internal, RolloutError

__all__ = [
    "INTERNAL_MESSAGE",
    "MAX_MESSAGE_BYTES",
    "MAX_MESSAGE_CHARS",
    "bounded_message",
    "handles_errors",
    "rpc_errors",
]

_LOG = logging.getLogger(__name__)
INTERNAL_MESSAGE = "internal server error (see the server log)"
MAX_MESSAGE_CHARS = 1024
# grpc sends the message percent-encoded in the grpc-message trailer: each UTF-8 byte outside
# printable ASCII takes 3 bytes there. 1024 four-byte characters (12 KiB on the wire) passed
# grpc's 8 KiB soft metadata limit, and the client got RESOURCE_EXHAUSTED "received metadata size
# exceeds soft limit" on about every other call; at most this many UTF-8 bytes stay under 3 KiB.
MAX_MESSAGE_BYTES = 1024
_Handler = TypeVar("_Handler", bound=Callable[..., Any])


@contextmanager
def rpc_errors(context: grpc.ServicerContext, method: str) -> Iterator[None]:
    """Abort the call with the status an exception escaping the block maps to."""
    try:
        yield
    except RolloutError as exc:
        _LOG.info("%s failed: %s %s", method, exc.code.name, bounded_message(exc.message))
        _abort(context, exc)
    except Exception:
        if context.code() is not None:
            # The handler (or grpc) already set a status, e.g. via context.abort: keep it.
            raise
        if not context.is_active():
            # The client cancelled or the deadline passed: nobody is left to tell. Abort rather
            # than return: a unary handler (UpdateWeights) that returns None here made grpc log
            # "Exception serializing message!" with a traceback for every cut upload.
            _LOG.debug("%s ended after the call was cancelled", method, exc_info=True)
            _abort(context, Cancelled("the call was cancelled"))
        _LOG.exception("%s failed with an unexpected error", method)
        _abort(context, Internal(INTERNAL_MESSAGE))


def _abort(context: grpc.ServicerContext, error: RolloutError) -> None:
    """End the call with the error's status; its code comes from the table in errors.py."""
    context.abort(error.code, bounded_message(error.message))


def bounded_message(message: str) -> str:
    """At most MAX_MESSAGE_CHARS characters and MAX_MESSAGE_BYTES UTF-8 bytes of a status
    message (its start names the field).

    Messages quote the offending value, and a client's value can be any length: a 70,000-character
    algorithm.preset made the status details larger than HTTP/2's 16 KiB metadata limit, so the
    client got RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" instead of the
    INVALID_ARGUMENT naming the field (and the server log a 70 KB line).
    """
    if len(message) <= MAX_MESSAGE_CHARS and len(message.encode("utf-8", "replace")) <= (
        MAX_MESSAGE_BYTES
    ):
        return message
    head = message[:MAX_MESSAGE_CHARS].encode("utf-8", "replace")[:MAX_MESSAGE_BYTES]
    kept = head.decode("utf-8", "ignore")  # without a character the byte cut split
    return f"{kept}... ({len(message) - len(kept)} more characters)"


def handles_errors(handler: _Handler) -> _Handler:
    """Decorate a servicer method (unary or server-streaming generator) with `rpc_errors`."""
    method = handler.__name__

    if inspect.isgeneratorfunction(handler):

        @functools.wraps(handler)
        def stream_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with rpc_errors(context, method):
                yield from handler(self, request, context)

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(handler)
    def unary_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        with rpc_errors(context, method):
            return handler(self, request, context)

    return unary_wrapper  # type: ignore[return-value]
