"""Channel construction shared by the sync client (and later the asyncio one).

Options follow shared/reference/transport.md: bounded message sizes on both sides (never -1),
keepalive for long streams, and gRPC's own retry policy (service config) instead of hand-written
loops: only UNAVAILABLE is retried, only on idempotent methods. UpdateWeights is deliberately
absent from the retry policy: a weight stream is never replayed automatically.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import grpc

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVICE_NAME = "rollserve.v1.Rollout"

_RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.2s",
    "maxBackoff": "5s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}

# MakeExperience is idempotent (it reads the weights, never changes them); gRPC retries a
# server-streaming call only until the first response arrives, so no micro-batch is duplicated.
SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [
                {"service": SERVICE_NAME, "method": "Health"},
                {"service": SERVICE_NAME, "method": "MakeExperience"},
                {"service": "grpc.health.v1.Health", "method": "Check"},
            ],
            "retryPolicy": _RETRY_POLICY,
        }
    ]
}


def channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    extra: Sequence[tuple[str, object]] = (),
) -> list[tuple[str, object]]:
    """gRPC channel arguments for talking to a rollserve server."""
    if max_message_bytes <= 0:
        raise ValueError("max_message_bytes must be positive (a finite limit)")
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
        *extra,
    ]


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
