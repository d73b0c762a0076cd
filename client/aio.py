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
(protocol/wire.py), sent through the same raw-bytes method. Subscribe runs on that sync channel
too, read by a thread of its own whose replies the loop awaits: its acknowledgements are written
while the server may end the call, which grpc.aio would report as INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import torch

from ..v1 import rollout_pb2 as pb
from .calls import (
    DEFAULT_SUBSCRIBE_WINDOW,
    BaseClient,
    SubscribedBatch,
    SubscribeRequests,
    check_progress,
    join_micro_batches,
    land,
    landing_device,
    subscribe_request,
    subscribed_batch,
    wait_bounds,
)
from .channel import open_aio_channel, open_channel
from .client import POLL_CALL_S
from .protocol.errors import DeadlineExceeded, RolloutError, Unavailable, typed_errors
from .protocol.experience import Experience, experience_from_proto
from .protocol.requests import ExperienceOptions, Progress, Prompts, UpdateOptions
from .protocol.results import HealthStatus, UpdateResult
from .weights.distributed import WeightsGroup
from .weights.update_file import Weights

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
        timeout_s, poll_s = wait_bounds(timeout_s, poll_s)
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
        options: ExperienceOptions | None = None,
        *,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        **fields: Any,
    ) -> AsyncIterator[Experience]:
        """Experience micro-batches as the server makes them; closing early cancels the call."""
        device = landing_device(device)
        request = ExperienceOptions.of(options, **fields)
        # aclosing: an abandoned stream cancels the call now, not when garbage collected.
        async with contextlib.aclosing(self._micro_batches(prompts, timeout_s, request)) as replies:
            async for experience, _ in replies:
                yield land(experience, device)

    async def make_experience(
        self,
        prompts: Prompts,
        options: ExperienceOptions | None = None,
        *,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        **fields: Any,
    ) -> Experience:
        """All rows of one request as one Experience (options: see RolloutClient)."""
        device = landing_device(device)
        request = ExperienceOptions.of(options, **fields)
        replies = [r async for r in self._micro_batches(prompts, timeout_s, request)]
        return land(join_micro_batches(replies), device)

    async def _micro_batches(
        self, prompts: Prompts, timeout_s: float | None, options: ExperienceOptions
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
        window: int = DEFAULT_SUBSCRIBE_WINDOW,
    ) -> AsyncIterator[SubscribedBatch]:
        """Batches of the server's continuous rollout (see RolloutClient.subscribe, `window`
        included); closing the iterator (aclose, or leaving `async for` early) cancels the
        call."""
        device = landing_device(device)
        requests = SubscribeRequests(subscribe_request(subscriber_id, max_batches, window))
        # A sync call read by a thread of its own (calls.py: _subscribe_call says why), its
        # replies handed to the loop; at most `window` of them wait at once.
        call = self._subscribe_call(requests, timeout_s)
        loop = asyncio.get_running_loop()
        replies: asyncio.Queue[pb.SubscribeResponse | grpc.RpcError | None] = asyncio.Queue()
        threading.Thread(
            target=_read_replies, args=(call, loop, replies), name="subscribe-replies", daemon=True
        ).start()
        try:
            with typed_errors():
                while (reply := await replies.get()) is not None:
                    if isinstance(reply, grpc.RpcError):
                        raise reply
                    yield subscribed_batch(reply, device)
                    requests.took_one()  # the trainer is back: it took that batch
        finally:
            requests.close()
            call.cancel()

    async def update_weights(
        self,
        weights: Weights,
        *,
        version: int,
        group: WeightsGroup | None = None,
        progress: Progress | None = None,
        options: UpdateOptions | None = None,
        **fields: Any,
    ) -> UpdateResult:
        """Send weights to the server; the arguments of RolloutClient.update_weights.

        The upload runs in a worker thread on this client's sync upload channel (see
        `_open_upload_channel`); `progress` is called on the event loop. Never retried.
        Cancelling the awaiting task stops a "grpc" or "shm" upload at its next message, so the
        server applies nothing unless the whole file was already sent (a "dist" broadcast or a
        "cuda_ipc" hand-over, once started, runs to its end).
        """
        options = UpdateOptions.of(options, **fields)
        check_progress(progress)
        loop = asyncio.get_running_loop()

        def report(sent: int, total: int) -> None:  # from a sending thread
            loop.call_soon_threadsafe(progress, sent, total)

        on_loop = None if progress is None else report
        # Set when the task is cancelled: the thread itself cannot be, and it went on sending
        # the update, which the server applied after the caller saw CancelledError.
        cancel = threading.Event()
        try:
            return await asyncio.to_thread(
                self._send_update, weights, version, options,
                group=group, progress=on_loop, cancel=cancel,
            )  # fmt: skip
        except asyncio.CancelledError:
            cancel.set()
            raise

    def _open_upload_channel(self) -> grpc.Channel:
        """UpdateWeights streams on a sync channel of this client's settings.

        Why not grpc.aio: when the server ends the call early (a stale version, a NaN in a
        chunk) while messages are still being written, grpc.aio's failed write replaces the
        server's status with INTERNAL "Internal error from Core" (grpcio 1.85; grpc/grpc#36066),
        often enough to matter for stale-version updates of tens of MB. The sync stream keeps the
        server's status, and runs the message generator in gRPC's own thread, off the event loop
        (a sync channel connects on first use: nothing is opened until the first update).
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


def _read_replies(
    call: Any,
    loop: asyncio.AbstractEventLoop,
    replies: asyncio.Queue[pb.SubscribeResponse | grpc.RpcError | None],
) -> None:
    """Hand a sync Subscribe call's replies to the event loop, then None (or the error)."""
    try:
        for reply in call:
            loop.call_soon_threadsafe(replies.put_nowait, reply)
        end: grpc.RpcError | None = None
    except grpc.RpcError as error:
        end = error
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(replies.put_nowait, end)
