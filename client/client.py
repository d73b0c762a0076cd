"""RolloutClient: the synchronous trainer-side client of a rollserve server."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from .calls import (
    DEFAULT_SUBSCRIBE_WINDOW,
    BaseClient,
    SubscribedBatch,
    SubscribeRequests,
    join_micro_batches,
    land,
    landing_device,
    subscribe_request,
    subscribed_batch,
    wait_bounds,
)
from .channel import open_channel
from .protocol.errors import DeadlineExceeded, RolloutError, Unavailable, typed_errors
from .protocol.experience import Experience, experience_from_proto
from .protocol.requests import ExperienceOptions, Prompts
from .protocol.results import HealthStatus

__all__ = ["RolloutClient"]

# Longest single Health poll inside wait_until_ready: a hung server must not eat the budget.
POLL_CALL_S = 5.0


class RolloutClient(BaseClient):
    """A connection to one rollserve server.

    Every call has a deadline (`timeout_s`, defaulting to the client's) and carries the client's
    metadata: `token` as "authorization: Bearer <token>" plus any `metadata` pairs. TLS comes
    from `credentials`, or from PEM bytes (`root_certificates`; `private_key` and
    `certificate_chain` for mutual TLS). Without TLS the token travels in clear text.
    Errors are raised as the typed exceptions of `rollserve.client`, carrying the gRPC
    status in `.code`. Health and MakeExperience are retried by gRPC on UNAVAILABLE (see
    `rollserve.client.channel`); UpdateWeights never is.
    """

    _open_channel = staticmethod(open_channel)

    def health(self, *, timeout_s: float | None = None) -> HealthStatus:
        """The server's readiness, model versions and load."""
        return self._health(timeout_s, wait_for_ready=False)

    def _health(self, timeout_s: float | None, *, wait_for_ready: bool) -> HealthStatus:
        with typed_errors():
            reply = self._health_call(timeout_s, wait_for_ready=wait_for_ready)
        return HealthStatus.from_proto(reply)

    def wait_until_ready(self, timeout_s: float = 60.0, *, poll_s: float = 0.2) -> HealthStatus:
        """Block until the server reports SERVING; DeadlineExceeded after `timeout_s`.

        Polls use gRPC's wait-for-ready, so a server that is not listening yet is waited for
        instead of failing fast; a listening server that is still loading is polled.
        """
        timeout_s, poll_s = wait_bounds(timeout_s, poll_s)
        deadline = time.monotonic() + timeout_s
        last: HealthStatus | RolloutError | None = None
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                last = self._health(min(remaining, POLL_CALL_S), wait_for_ready=True)
                if last.serving:
                    return last
            except (Unavailable, DeadlineExceeded) as error:  # not listening yet, or loading
                last = error
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0)))
        raise DeadlineExceeded(f"{self.target} not SERVING after {timeout_s:.1f} s (last: {last})")

    def stream_experience(
        self,
        prompts: Prompts,
        options: ExperienceOptions | None = None,
        *,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        **fields: Any,
    ) -> Iterator[Experience]:
        """Experience micro-batches as the server makes them (options: see make_experience).

        Closing the iterator early cancels the call, so the server stops making the rest.
        """
        device = landing_device(device)
        request = ExperienceOptions.of(options, **fields)
        # closing: an abandoned stream cancels the call now, not when garbage collected.
        with contextlib.closing(self._micro_batches(prompts, timeout_s, request)) as replies:
            for experience, _ in replies:
                yield land(experience, device)

    def make_experience(
        self,
        prompts: Prompts,
        options: ExperienceOptions | None = None,
        *,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        **fields: Any,
    ) -> Experience:
        """All rows of one request as one Experience, pinned when CUDA is present.

        `prompts` are token-id lists or strings. The request's options are `options` (an
        ExperienceOptions) and/or its fields as keywords: samples_per_prompt, max_new_tokens,
        temperature, seed, preset, algorithm={...}, rewards={...}, request_id, ... (see
        ExperienceOptions). A `request_id` also travels as x-request-id call metadata.
        """
        device = landing_device(device)
        request = ExperienceOptions.of(options, **fields)
        replies = list(self._micro_batches(prompts, timeout_s, request))
        return land(join_micro_batches(replies), device)

    def _micro_batches(
        self, prompts: Prompts, timeout_s: float | None, options: ExperienceOptions
    ) -> Iterator[tuple[Experience, int]]:
        call = self._make_experience_call(prompts, timeout_s, options)
        try:
            with typed_errors():
                for reply in call:
                    yield experience_from_proto(reply.experience), reply.pad_token_id
        finally:
            call.cancel()  # a no-op after the last reply; frees the server when abandoned

    def subscribe(
        self,
        subscriber_id: str = "",
        max_batches: int = 0,
        *,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        window: int = DEFAULT_SUBSCRIBE_WINDOW,
    ) -> Iterator[SubscribedBatch]:
        """Batches of the server's continuous rollout (--rollout-prompts) dealt to this trainer.

        Several subscribers share the rollout round-robin; each batch goes to one of them. The
        stream ends when the rollout is finished or after `max_batches` (0: no limit).
        `timeout_s` bounds the whole subscription: give a long rollout a long one. Closing the
        iterator cancels the call; batches not sent yet go to the other subscribers.
        Back-pressure: the server hands over at most `window` batches the trainer has not
        taken; a batch counts as taken when the trainer asks for the next one (the default, 1:
        each batch is handed over, and checked against the server's --max-staleness, when the
        trainer asks for it; 0: no acknowledgements, as clients before windows).
        FailedPrecondition when the server runs no continuous rollout.
        """
        device = landing_device(device)
        requests = SubscribeRequests(subscribe_request(subscriber_id, max_batches, window))
        call = self._subscribe_call(requests, timeout_s)
        try:
            with typed_errors():
                for reply in call:
                    yield subscribed_batch(reply, device)
                    requests.took_one()  # the trainer is back: it took that batch
        finally:
            requests.close()  # gRPC's thread stops reading the request stream
            call.cancel()  # a no-op after the last batch; leaves the ring when abandoned

    # Send weights to the server: the shared implementation is the sync client's method.
    update_weights = BaseClient._update

    def close(self) -> None:
        """Close the channel; calls still running are cancelled."""
        self._uploads.close()
        self._channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
