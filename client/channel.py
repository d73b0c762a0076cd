"""Channel construction shared by the sync and asyncio clients.

The options: bounded message sizes on both sides (never -1, so a peer cannot make us buffer
without limit), keepalive for long streams, and gRPC's own retry policy (service config) instead
of hand-written loops: only UNAVAILABLE is retried, only on idempotent methods. UpdateWeights is
deliberately absent from the retry policy: a weight stream is never replayed automatically.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import grpc

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_MESSAGE_BYTES",
    "RETRIED_METHODS",
    "SERVICE_CONFIG",
    "SERVICE_NAME",
    "channel_credentials",
    "channel_options",
    "open_aio_channel",
    "open_channel",
]

# 65 MiB: the largest weight chunk (64 MiB) plus its message framing fits.
DEFAULT_MAX_MESSAGE_BYTES = 65 * 1024 * 1024
# gRPC's message length options are C ints.
MAX_MESSAGE_BYTES = (1 << 31) - 1
SERVICE_NAME = "rollserve.v1.Rollout"

_RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.2s",
    "maxBackoff": "5s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}

# (service, method) pairs gRPC retries on UNAVAILABLE. MakeExperience is idempotent (it reads
# the weights, never changes them); gRPC retries a server-streaming call only until the first
# response arrives, so no micro-batch is duplicated.
RETRIED_METHODS: tuple[tuple[str, str], ...] = (
    (SERVICE_NAME, "Health"),
    (SERVICE_NAME, "MakeExperience"),
    ("grpc.health.v1.Health", "Check"),
)

SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": service, "method": method} for service, method in RETRIED_METHODS],
            "retryPolicy": _RETRY_POLICY,
        }
    ]
}


def channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    extra: Sequence[tuple[str, object]] = (),
) -> list[tuple[str, object]]:
    """gRPC channel arguments for talking to a rollserve server."""
    # gRPC takes the limit as a C int: a larger one raised OverflowError, and a bool or a float
    # was passed on (True: a one-byte limit that failed every call).
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int):
        raise TypeError(f"max_message_bytes must be an int, got {max_message_bytes!r}")
    if not 0 < max_message_bytes <= MAX_MESSAGE_BYTES:
        raise ValueError(
            f"max_message_bytes must be in [1, {MAX_MESSAGE_BYTES}] (a finite limit), got "
            f"{max_message_bytes}"
        )
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC's defaults (1 s initial, up to 120 s) leave a trainer idle for minutes after a
        # server restart; a rollout server is worth reconnecting to within seconds.
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 5_000),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
        *extra,
    ]


def channel_credentials(
    *,
    credentials: grpc.ChannelCredentials | None = None,
    root_certificates: bytes | None = None,
    private_key: bytes | None = None,
    certificate_chain: bytes | None = None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials from PEM bytes (mutual TLS with a key and chain), or None for plaintext.

    `root_certificates=None` with a key and chain uses the system roots. Ready-made
    `credentials` exclude the PEM arguments.
    """
    pem = (root_certificates, private_key, certificate_chain)
    if credentials is not None:
        if any(value is not None for value in pem):
            raise ValueError("give either credentials or PEM bytes, not both")
        return credentials
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("mutual TLS needs both private_key and certificate_chain")
    if all(value is None for value in pem):
        return None
    names = ("root_certificates", "private_key", "certificate_chain")
    for name, value in zip(names, pem, strict=True):
        if value is not None and not isinstance(value, bytes):
            raise TypeError(f"{name} must be PEM bytes, got {type(value).__name__}")
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def open_channel(
    target: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    extra_options: Sequence[tuple[str, object]] = (),
) -> grpc.Channel:
    """A sync channel to `target` ("host:port"); TLS when credentials are given."""
    options = channel_options(max_message_bytes, extra_options)
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def open_aio_channel(
    target: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    extra_options: Sequence[tuple[str, object]] = (),
) -> grpc.aio.Channel:
    """The asyncio twin of `open_channel`; call it with the event loop running."""
    options = channel_options(max_message_bytes, extra_options)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)
