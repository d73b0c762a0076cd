"""RolloutClient: the synchronous trainer-side client of a rollserve server."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar

import grpc
import torch
from rollserve.client.channel import DEFAULT_MAX_MESSAGE_BYTES, open_channel
from rollserve.client.errors import DeadlineExceeded, RolloutError, Unavailable, from_rpc_error
from rollserve.client.experience import Experience, concat_experiences, experience_from_proto
from rollserve.client.requests import Prompts, build_make_experience_request
from rollserve.client.results import HealthStatus, UpdateResult
from rollserve.client.weights import DEFAULT_CHUNK_BYTES, update_weights_requests
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

    def stream_experience(
        self,
        prompts: Prompts,
        *,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        **options: object,
    ) -> Iterator[Experience]:
        """Experience micro-batches as the server makes them (options: see make_experience)."""
        for experience in self._micro_batches(prompts, timeout_s, options):
            yield _land(experience, device)

    def make_experience(
        self,
        prompts: Prompts,
        *,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        **options: object,
    ) -> Experience:
        """All rows of one request as one Experience, pinned when CUDA is present.

        `prompts` are token-id lists or strings; `options` are the keyword arguments of
        `rollserve.client.requests.build_make_experience_request` (samples_per_prompt,
        max_new_tokens, temperature, seed, preset, algorithm={...}, rewards={...}, ...).
        """
        batches = list(self._micro_batches(prompts, timeout_s, options))
        return _land(concat_experiences(batches), device)

    def _micro_batches(
        self, prompts: Prompts, timeout_s: float | None, options: Mapping[str, object]
    ) -> Iterator[Experience]:
        request = build_make_experience_request(prompts, **options)
        with _typed_errors():
            for reply in self._stub.MakeExperience(request, timeout=self._timeout(timeout_s)):
                yield experience_from_proto(reply.experience)

    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | torch.nn.Module,
        *,
        version: int,
        target: str = "actor",
        mode: str = "full",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float | None = None,
        progress: Callable[[int, int], None] | None = None,
        **stream_options: object,
    ) -> UpdateResult:
        """Stream weights to the server, which verifies them and swaps atomically.

        Never retried automatically. `progress(sent_bytes, total_bytes)` is called per chunk.
        `stream_options` go to `update_weights_requests` (crc32, sha256, lora, ...).
        """
        requests = update_weights_requests(
            weights, target=target, version=version, mode=mode, chunk_bytes=chunk_bytes,
            **stream_options,
        )
        started_s = time.monotonic()
        with _typed_errors():
            reply = self._stub.UpdateWeights(
                _with_progress(requests, progress), timeout=self._timeout(timeout_s)
            )
        return UpdateResult.from_proto(reply, wall_s=time.monotonic() - started_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s


def _land(experience: Experience, device: torch.device | str | None) -> Experience:
    """Pinned host memory when CUDA is present (ready for a non-blocking copy), or `device`."""
    if device is not None:
        return experience.to_device(device, non_blocking=True)
    return experience.pin_memory()


def _with_progress(
    requests: Iterator[pb.UpdateWeightsRequest], progress: Callable[[int, int], None] | None
) -> Iterator[pb.UpdateWeightsRequest]:
    if progress is None:
        yield from requests
        return
    total = sent = 0
    for request in requests:
        if request.HasField("header"):
            total = request.header.total_bytes
        else:
            sent += len(request.chunk.data)
        yield request
        progress(sent, total)
