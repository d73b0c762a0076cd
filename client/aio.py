"""AsyncRolloutClient: the asyncio (grpc.aio) twin of RolloutClient.

Same arguments, results and exceptions as the sync client (shared through
`rollserve.client.calls`); only the waiting differs. Create it inside a running event loop
(grpc.aio binds a channel to the loop it was made in), e.g. `async with AsyncRolloutClient(...)`.

CPU work and the event loop: decoding a micro-batch is zero-copy and runs on the loop (landing
in pinned memory, with CUDA present, is one copy per micro-batch). Building an UpdateWeights
stream is not cheap (each 1 MiB chunk message is one copy out of the tensors, plus its CRC when
asked for; a GPU tensor is first copied to the host whole, sha256=True reads everything once
more), so the header is built in a worker thread and the chunk messages in gRPC's sending
thread: the upload goes through a sync channel of the same settings (see `_open_upload_channel`
for why), and the loop only waits. The messages are the sync client's hand-encoded bytes
(client/wire.py), sent through the same raw-bytes method.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping

import grpc
import torch

from .calls import (
    BaseClient,
    SubscribedBatch,
    join_micro_batches,
    land,
    subscribed_batch,
    typed_errors,
)
from .channel import open_aio_channel, open_channel
from .client import POLL_CALL_S
from .protocol.errors import DeadlineExceeded, RolloutError, Unavailable
from .protocol.experience import Experience, experience_from_proto
from .protocol.requests import Prompts
from .results import HealthStatus, UpdateResult
from .weights.distributed import WeightsGroup
from .weights.update_file import DEFAULT_CHUNK_BYTES

__all__ = ["AsyncRolloutClient"]


class AsyncRolloutClient(BaseClient):
    """A grpc.aio connection to one rollserve server; see RolloutClient for the options."""

    _open_channel = staticmethod(open_aio_channel)

    async def health(self, *, timeout_s: float | None = None) -> HealthStatus:
        """The server's readiness, model versions and load."""
        return await self._health(timeout_s, wait_for_ready=False)

    async def _health(self, timeout_s: float | None, *, wait_for_ready: bool) -> HealthStatus:
        with typed_errors():
            reply = await self._health_call(timeout_s, wait_for_ready=wait_for_ready)
        return HealthStatus.from_proto(reply)

    async def wait_until_ready(
        self, timeout_s: float = 60.0, *, poll_s: float = 0.2
    ) -> HealthStatus:
        """Wait until the server reports SERVING; DeadlineExceeded after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        last: HealthStatus | RolloutError | None = None
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                last = await self._health(min(remaining, POLL_CALL_S), wait_for_ready=True)
                if last.serving:
                    return last
            except (Unavailable, DeadlineExceeded) as error:  # not listening yet, or loading
                last = error
            await asyncio.sleep(min(poll_s, max(deadline - time.monotonic(), 0)))
        raise DeadlineExceeded(f"{self.target} not SERVING after {timeout_s:.1f} s (last: {last})")

    async def stream_experience(
        self,
        prompts: Prompts,
        *,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        **options: object,
    ) -> AsyncIterator[Experience]:
        """Experience micro-batches as the server makes them; closing early cancels the call."""
        # aclosing: an abandoned stream cancels the call now, not when garbage collected.
        async with contextlib.aclosing(self._micro_batches(prompts, timeout_s, options)) as replies:
            async for experience, _ in replies:
                yield land(experience, device)

    async def make_experience(
        self,
        prompts: Prompts,
        *,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        **options: object,
    ) -> Experience:
        """All rows of one request as one Experience (options: see RolloutClient)."""
        replies = [r async for r in self._micro_batches(prompts, timeout_s, options)]
        return land(join_micro_batches(replies), device)

    async def _micro_batches(
        self, prompts: Prompts, timeout_s: float | None, options: Mapping[str, object]
    ) -> AsyncIterator[tuple[Experience, int]]:
        call = self._make_experience_call(prompts, timeout_s, options)
        try:
            with typed_errors():
                async for reply in call:
                    yield experience_from_proto(reply.experience), reply.pad_token_id
        finally:
            call.cancel()  # a no-op after the last reply; frees the server when abandoned

    async def subscribe(
        self,
        subscriber_id: str = "",
        max_batches: int = 0,
        *,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
    ) -> AsyncIterator[SubscribedBatch]:
        """Batches of the server's continuous rollout (see RolloutClient.subscribe); closing
        the iterator (aclose, or leaving `async for` early) cancels the call."""
        call = self._subscribe_call(subscriber_id, max_batches, timeout_s)
        try:
            with typed_errors():
                async for reply in call:
                    yield subscribed_batch(reply, device)
        finally:
            call.cancel()

    async def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | torch.nn.Module,
        *,
        version: int,
        target: str = "actor",
        mode: str = "full",
        transport: str = "auto",
        streams: int | None = None,
        group: WeightsGroup | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float | None = None,
        request_id: str | None = None,
        progress: Callable[[int, int], None] | None = None,
        **stream_options: object,
    ) -> UpdateResult:
        """Send weights to the server (see RolloutClient.update_weights); never retried.

        The upload runs in a worker thread on this client's sync upload channel (see
        `_open_upload_channel`); `progress` is called on the event loop.
        """
        loop = asyncio.get_running_loop()

        def report(sent: int, total: int) -> None:  # from a sending thread
            loop.call_soon_threadsafe(progress, sent, total)

        return await asyncio.to_thread(
            self._update, weights, version=version, target=target, mode=mode,
            transport=transport, streams=streams, group=group, chunk_bytes=chunk_bytes,
            timeout_s=timeout_s, request_id=request_id,
            progress=None if progress is None else report, **stream_options,
        )  # fmt: skip

    def _open_upload_channel(self) -> grpc.Channel:
        """UpdateWeights streams on a sync channel of this client's settings.

        Why not grpc.aio: when the server ends the call early (a stale version, a NaN in a
        chunk) while messages are still being written, grpc.aio's failed write replaces the
        server's status with INTERNAL "Internal error from Core" (grpcio 1.85; grpc/grpc#36066);
        measured: 4 of 20 stale-version updates of 32 MB. The sync stream keeps the server's
        status, and runs the message generator in gRPC's own thread, off the event loop (a sync
        channel connects on first use: nothing is opened until the first update).
        """
        return open_channel(self.target, **self._channel_settings)

    async def close(self) -> None:
        """Close the channel; calls still running are cancelled."""
        self._uploads.close()
        self._upload_channel.close()
        await self._channel.close()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
