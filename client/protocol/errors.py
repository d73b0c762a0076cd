"""The one table of rollserve's domain errors and their gRPC status codes.

Server and client share it: the server raises these (its servicer turns them into
`context.abort(code, message)` in one place, server/serving/status.py; the auth interceptor
refuses with the Unauthenticated / PermissionDenied that security.authorize returns), and the
client turns a `grpc.RpcError` back into the same classes (`from_rpc_error`, `typed_errors`), so
a trainer catches `FailedPrecondition` whether the model ran in-process or on another machine. A
new error is a class here with its `code`; nothing else maps exceptions to statuses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

__all__ = [
    "RolloutError",
    "InvalidArgument",
    "FailedPrecondition",
    "ResourceExhausted",
    "Unavailable",
    "Unauthenticated",
    "PermissionDenied",
    "DeadlineExceeded",
    "Cancelled",
    "Unimplemented",
    "Internal",
    "TensorCodecError",
    "error_for_status",
    "from_rpc_error",
    "typed_errors",
]


class RolloutError(Exception):
    """Base class of every rollserve error; `code` is the gRPC status it travels as."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, details: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # Only set on the client: the raw status details as received.
        self.details = details


class InvalidArgument(RolloutError):
    """The request is malformed; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(RolloutError):
    """Stale or wrong version, or a model the request needs is not loaded."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(RolloutError):
    """Queue full or over a limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RolloutError):
    """The server cannot take the call now; the only code that is safe to retry."""

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(RolloutError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(RolloutError):
    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(RolloutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(RolloutError):
    code = grpc.StatusCode.CANCELLED


class Unimplemented(RolloutError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(RolloutError):
    """An unexpected failure; the wire message is generic on purpose (no internals leak)."""

    code = grpc.StatusCode.INTERNAL


class TensorCodecError(InvalidArgument):
    """A `Tensor` message that cannot be decoded: unknown dtype, bad shape or byte length."""


_BY_CODE: dict[grpc.StatusCode, type[RolloutError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
        DeadlineExceeded,
        Cancelled,
        Unimplemented,
        Internal,
    )
}


def error_for_status(code: grpc.StatusCode) -> type[RolloutError]:
    """The exception class for a status code (RolloutError for codes outside the table)."""
    return _BY_CODE.get(code, RolloutError)


def from_rpc_error(error: grpc.RpcError) -> RolloutError:
    """Turn a grpc.RpcError (which is also a grpc.Call) into the matching typed exception."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = error_for_status(code)
    exc = cls(f"{code.name}: {details}", details=details)
    if cls is RolloutError:
        exc.code = code
    return exc


@contextmanager
def typed_errors() -> Iterator[None]:
    """Raise a grpc.RpcError (grpc.aio.AioRpcError included) leaving the block as its class of
    this table."""
    try:
        yield
    except grpc.RpcError as error:
        raise from_rpc_error(error) from None
