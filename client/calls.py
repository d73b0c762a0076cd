"""What RolloutClient and AsyncRolloutClient share.

Construction (target, deadline, token and metadata, TLS, channel options) and the start of each
call (`BaseClient`), deadlines, metadata (bearer token, request ids), error translation, landing
of experience, and Subscribe's request and batches live here once, so that the two clients
differ only in how they wait.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc
import torch

from ..v1 import rollout_pb2 as pb
from ..v1 import rollout_pb2_grpc
from .channel import DEFAULT_MAX_MESSAGE_BYTES, channel_credentials, open_channel
from .protocol.errors import typed_errors
from .protocol.experience import Experience, concat_experiences, experience_from_proto
from .protocol.requests import ExperienceOptions, Progress, Prompts, UpdateOptions
from .protocol.results import UpdateResult
from .protocol.wire import update_weights_callable
from .weights.distributed import WeightsGroup, group_of
from .weights.server_calls import CallOptions, ServerCalls
from .weights.update_file import Weights, prepare_update
from .weights.upload import Uploads

__all__ = [
    "join_micro_batches",
    "AUTHORIZATION_KEY",
    "DEFAULT_SUBSCRIBE_WINDOW",
    "MAX_REQUEST_ID_CHARS",
    "MAX_TIMEOUT_S",
    "REQUEST_ID_KEY",
    "BaseClient",
    "CallSettings",
    "Metadata",
    "SubscribeRequests",
    "SubscribedBatch",
    "check_progress",
    "land",
    "landing_device",
    "subscribe_request",
    "subscribed_batch",
    "wait_bounds",
]

AUTHORIZATION_KEY = "authorization"
REQUEST_ID_KEY = "x-request-id"
# Extra call metadata: (key, value) pairs; values are str, or bytes for keys ending in "-bin".
Metadata = Sequence[tuple[str, str | bytes]]
# HTTP/2 header names as gRPC accepts them (lowercase); "grpc-" names are reserved.
_KEY = re.compile(r"[0-9a-z_.\-]+")
# The longest request id a server takes (server/serving/interceptors.py); it replaces a longer one
# with a fresh id, and one past gRPC's 16 KiB metadata limit failed the call RESOURCE_EXHAUSTED
# ("received metadata size exceeds hard limit", a code that says retry) instead of being refused.
MAX_REQUEST_ID_CHARS = 128


def _check_ascii(name: str, value: str) -> str:
    if not isinstance(value, str) or not value.isascii() or not value.isprintable():
        raise ValueError(f"{name} must be printable ASCII text, got {value!r}")
    return value


def _check_pair(key: str, value: str | bytes) -> tuple[str, str | bytes]:
    if not isinstance(key, str) or not _KEY.fullmatch(key) or key.startswith("grpc-"):
        raise ValueError(f"metadata key {key!r}: lowercase [0-9a-z_.-], not grpc-*")
    if key.endswith("-bin"):
        if not isinstance(value, bytes):
            raise TypeError(f"metadata {key!r}: binary keys (-bin) take bytes")
        return key, value
    return key, _check_ascii(f"metadata {key!r}", value)


@dataclass(frozen=True)
class CallSettings:
    """One client's per-call defaults: the deadline and the metadata sent on every call."""

    timeout_s: float
    metadata: tuple[tuple[str, str | bytes], ...] = ()

    @classmethod
    def build(cls, *, timeout_s: float, token: str | None, metadata: Metadata) -> CallSettings:
        """Validated settings; `token` travels as "authorization: Bearer <token>"."""
        # A dict iterated as pairs failed "not enough values to unpack"; ["ab"] was ("a", "b").
        if isinstance(metadata, str | bytes | Mapping) or not all(
            isinstance(pair, tuple | list) and len(pair) == 2 for pair in metadata
        ):
            raise TypeError(f"metadata must be a sequence of (key, value) pairs, got {metadata!r}")
        pairs = [_check_pair(key, value) for key, value in metadata]
        if token is not None:
            if not token or any(c.isspace() for c in _check_ascii("token", token)):
                raise ValueError("token must be non-empty printable ASCII without whitespace")
            if any(key == AUTHORIZATION_KEY for key, _ in pairs):
                raise ValueError("give the bearer token either as token= or in metadata")
            pairs.insert(0, (AUTHORIZATION_KEY, f"Bearer {token}"))
        return cls(timeout_s=_check_timeout(timeout_s), metadata=tuple(pairs))

    def timeout(self, timeout_s: float | None) -> float:
        """The deadline of one call: the override, else the client's default."""
        return self.timeout_s if timeout_s is None else _check_timeout(timeout_s)

    def metadata_for(self, request_id: str | None = None) -> tuple[tuple[str, str | bytes], ...]:
        """The call's metadata; a request id replaces any client-wide x-request-id."""
        if not request_id:
            return self.metadata
        request_id = _check_ascii("request_id", request_id)
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(
                f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got "
                f"{len(request_id)}"
            )
        kept = tuple(pair for pair in self.metadata if pair[0] != REQUEST_ID_KEY)
        return (*kept, (REQUEST_ID_KEY, request_id))


# The longest deadline a call may have (about 3 years). gRPC turns a deadline past ~7e9 s from
# now into one already expired: every call with a larger timeout_s failed DEADLINE_EXCEEDED at
# once, without reaching the server.
MAX_TIMEOUT_S = 100_000_000.0


def _check_timeout(timeout_s: float, name: str = "timeout_s") -> float:
    # A deadline is mandatory on every call: no None, no infinity, no zero.
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {timeout_s!r}")
    if not (0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"{name} must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s!r}")
    return float(timeout_s)


def wait_bounds(timeout_s: float, poll_s: float) -> tuple[float, float]:
    """wait_until_ready's (timeout_s, poll_s), checked as a call's deadline is (sync and
    asyncio clients): nan or -1 waited for nothing and then said DeadlineExceeded."""
    return _check_timeout(timeout_s), _check_timeout(poll_s, "poll_s")


class BaseClient:
    """What RolloutClient and AsyncRolloutClient share: construction (options: RolloutClient)
    and the start of every call.

    A subclass names the function that opens its channel (sync or grpc.aio); the rest is the
    same: validated call settings, TLS credentials, the channel, its stub, and UpdateWeights as a
    raw-bytes method for the hand-encoded messages (protocol/wire.py: one copy from tensors).
    """

    # open_channel or open_aio_channel (as a staticmethod): target, credentials=,
    # max_message_bytes=, extra_options= -> a channel.
    _open_channel: ClassVar[Callable[..., Any]]

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 60.0,
        token: str | None = None,
        metadata: Metadata = (),
        credentials: grpc.ChannelCredentials | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        channel_options: Sequence[tuple[str, object]] = (),
    ) -> None:
        # gRPC failed on the first call only: AttributeError for a non-string, UNKNOWN for "".
        if not isinstance(target, str):
            raise TypeError(f"target must be a 'host:port' string, got {target!r}")
        if not target.strip():
            raise ValueError("target must be a non-empty 'host:port' string")
        self.target = target
        self._settings = CallSettings.build(timeout_s=timeout_s, token=token, metadata=metadata)
        tls = channel_credentials(
            credentials=credentials,
            root_certificates=root_certificates,
            private_key=private_key,
            certificate_chain=certificate_chain,
        )
        self._channel_settings: dict[str, Any] = dict(
            credentials=tls, max_message_bytes=max_message_bytes, extra_options=channel_options
        )
        self._channel = self._open_channel(target, **self._channel_settings)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)
        self._upload_channel = self._open_upload_channel()
        # Sync calls on the upload channel (for both clients): Health for the transport choice,
        # the weights-group RPCs, and UpdateWeights on one or more connections (upload.py).
        self._weights_calls = ServerCalls(
            self._upload_channel, self._call_options, max_message_bytes=max_message_bytes
        )
        self._uploads = Uploads(self._weights_calls, self._open_upload_stream)

    @property
    def weights_calls(self) -> ServerCalls:
        """This server's sync calls on the weights side (what a WeightsGroup uses)."""
        return self._weights_calls

    def _call_options(self, timeout_s: float | None, request_id: str | None) -> CallOptions:
        """One call's deadline (`timeout_s`, else the client's) and metadata."""
        return CallOptions(
            self._settings.timeout(timeout_s), self._settings.metadata_for(request_id)
        )

    def _open_upload_stream(self) -> tuple[Any, grpc.Channel]:
        """One more sync UpdateWeights callable on a TCP connection of its own (a channel with a
        local subchannel pool does not share the connection of this client's channels)."""
        settings = dict(self._channel_settings)
        settings["extra_options"] = [
            *settings["extra_options"],
            ("grpc.use_local_subchannel_pool", 1),
        ]
        channel = open_channel(self.target, **settings)
        return update_weights_callable(channel), channel

    def _open_upload_channel(self) -> Any:
        """The channel UpdateWeights streams on: this client's own (AsyncRolloutClient: a sync
        channel of the same settings)."""
        return self._channel

    @property
    def timeout_s(self) -> float:
        """The default deadline of every call."""
        return self._settings.timeout_s

    # Every call starts here, with its deadline and metadata. What comes back is the sync
    # stub's reply (or reply iterator), or grpc.aio's awaitable (or async iterator): each client
    # waits its own way, and turns gRPC errors into typed ones with typed_errors.

    def _health_call(self, timeout_s: float | None, *, wait_for_ready: bool) -> Any:
        return self._stub.Health(
            pb.HealthRequest(),
            timeout=self._settings.timeout(timeout_s),
            metadata=self._settings.metadata_for(),
            wait_for_ready=wait_for_ready,
        )

    def _make_experience_call(
        self, prompts: Prompts, timeout_s: float | None, options: ExperienceOptions
    ) -> Any:
        request = options.request(prompts)
        return self._stub.MakeExperience(
            request,
            timeout=self._settings.timeout(timeout_s),
            metadata=self._settings.metadata_for(request.request_id),
        )

    def _subscribe_call(
        self, requests: Iterator[pb.SubscribeRequest], timeout_s: float | None
    ) -> Any:
        """The Subscribe stream, a sync call on the upload channel for both clients: grpc.aio
        turns the status of a call that ends while an acknowledgement is being written into
        INTERNAL (see AsyncRolloutClient._open_upload_channel); a sync call keeps it."""
        return rollout_pb2_grpc.RolloutStub(self._upload_channel).Subscribe(
            requests,
            timeout=self._settings.timeout(timeout_s),
            metadata=self._settings.metadata_for(),
        )

    def share_weights(self, weights: Weights) -> None:
        """Make the weights' CPU tensors live in this client's shared memory (a sealed memfd):
        later updates of these tensors over transport "shm" (or "auto" on the server's host)
        copy nothing on the trainer's side; the server copies them once into its staging
        memory. For a module, its parameters and buffers themselves move (optimizers keep
        working on them). Do not train in another thread while an update runs.
        """
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict(keep_vars=True)
        self._uploads.share(weights)

    def _update(
        self,
        weights: Weights,
        *,
        version: int,
        group: WeightsGroup | None = None,
        progress: Progress | None = None,
        options: UpdateOptions | None = None,
        **fields: Any,
    ) -> UpdateResult:
        """Send weights to the server, which verifies them and swaps atomically.

        The update's options are `options` (an UpdateOptions) and/or its fields as keywords:
        target, mode (and lora), transport, streams, chunk_bytes, timeout_s, request_id, crc32,
        sha256, ... `transport`: "auto" (shared memory when the server is on this host, else
        gRPC), "grpc" (`streams` parallel connections; default one per 4 cores), "shm" (same
        host only) or "dist" (a broadcast through `group`, a WeightsGroup: every server of the
        group is updated and this server's result returned). Never retried automatically, and
        never sent another way than asked, except "auto" (see weights/upload.py).
        `progress(sent_bytes, total_bytes)` is called as bytes go out.

        RolloutClient.update_weights itself; AsyncRolloutClient runs its body (`_send_update`)
        in a worker thread.
        """
        options = UpdateOptions.of(options, **fields)
        check_progress(progress)
        return self._send_update(weights, version, options, group=group, progress=progress)

    def _send_update(
        self,
        weights: Weights,
        version: int,
        options: UpdateOptions,
        *,
        group: WeightsGroup | None = None,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> UpdateResult:
        """The body of `_update`; `cancel` set from another thread ends a gRPC or shared-memory
        upload before its next message (AsyncRolloutClient: the caller's task was cancelled);
        the caller has checked `progress` (check_progress)."""
        through = group_of(group, options.transport)
        if through is not None:
            index = through.index(self)
            results = through.update_weights(
                weights, version=version, progress=progress, options=options
            )
            return results[index]
        update = prepare_update(weights, version=version, options=options)
        call = self._call_options(options.timeout_s, options.request_id)
        started_s = time.monotonic()
        with typed_errors():
            reply = self._uploads.send(
                update, call, transport=options.transport, streams=options.streams,
                progress=progress, pack=options.pack, cancel=cancel,
            )  # fmt: skip
        return UpdateResult.from_proto(reply, wall_s=time.monotonic() - started_s)


def check_progress(progress: Progress | None) -> None:
    """TypeError for a progress callback that cannot be called: it was first called in gRPC's
    sending thread, and the update failed UNKNOWN "Exception iterating requests!"."""
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable as progress(sent, total), got {progress!r}")


def landing_device(device: torch.device | str | None) -> torch.device | None:
    """`device` parsed before a call starts: a name torch does not know ("nope", "cuda:x") was
    a RuntimeError only once the server had made the whole request."""
    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device: {device!r} is not a torch device ({error})") from None


def land(experience: Experience, device: torch.device | str | None) -> Experience:
    """Pinned host memory when CUDA is present (ready for a non-blocking copy), or `device`."""
    if device is not None:
        return experience.to_device(device, non_blocking=True)
    return experience.pin_memory()


def join_micro_batches(replies: Sequence[tuple[Experience, int]]) -> Experience:
    """One Experience from streamed (micro-batch, pad_token_id) pairs, padded as the server pads."""
    pad_token_id = replies[0][1] if replies else 0
    return concat_experiences([experience for experience, _ in replies], pad_token_id)


@dataclass(frozen=True)
class SubscribedBatch:
    """One batch of a server's continuous rollout, as Subscribe delivered it."""

    # Whole groups; prompt_index holds the prompt ids (rows) of the server's prompt source.
    experience: Experience
    batch_index: int  # batches delivered before this one, across all subscribers
    epoch: int  # pass over the prompt source that made it, from 0
    step: int  # position of the batch in the rollout's schedule, from 0


# Batches the server may hand a subscriber before its trainer took them. 1: the next batch is
# handed over when the trainer asks for it, so it is checked against --max-staleness after the
# trainer's last push (a window of w lets a trainer that pushes after every batch read batches up
# to w - 1 versions older, for overlapping w - 1 transfers with training). The server's queue
# still makes the next batch while the trainer trains.
DEFAULT_SUBSCRIBE_WINDOW = 1


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def subscribe_request(
    subscriber_id: str, max_batches: int, window: int = DEFAULT_SUBSCRIBE_WINDOW
) -> pb.SubscribeRequest:
    """A validated first SubscribeRequest (max_batches 0: until the rollout ends; window 0: no
    acknowledgements, as clients before windows; the server allows at most 16)."""
    if not isinstance(subscriber_id, str):
        raise TypeError(f"subscriber_id must be a string, got {subscriber_id!r}")
    return pb.SubscribeRequest(
        subscriber_id=subscriber_id,
        max_batches=_count("max_batches", max_batches),
        window=_count("window", window),
    )


class SubscribeRequests:
    """The request stream of a sync Subscribe call, which gRPC's own thread iterates: the first
    request, then one acknowledgement per batch the trainer took, until `close()` (window 0:
    closed after the first request, as a client before windows). Thread-safe."""

    def __init__(self, first: pb.SubscribeRequest) -> None:
        self._queue: queue.SimpleQueue[pb.SubscribeRequest | None] = queue.SimpleQueue()
        self._queue.put(first)
        self._window = first.window
        self._left = first.max_batches or None  # batches still to come; None: no limit
        if not first.window:
            self.close()

    def __iter__(self) -> SubscribeRequests:
        return self

    def __next__(self) -> pb.SubscribeRequest:
        request = self._queue.get()
        if request is None:
            self._queue.put(None)  # every later next() ends too
            raise StopIteration
        return request

    def took_one(self) -> None:
        """The trainer took one more batch and asks for the next: acknowledge it (with a window,
        unless it was the last of max_batches: the server ends the stream there)."""
        if self._left is not None:
            self._left -= 1
        if self._window and self._left != 0:
            self._queue.put(pb.SubscribeRequest(taken=1))

    def close(self) -> None:
        """No more requests: gRPC's thread stops iterating (and the stream half-closes)."""
        self._queue.put(None)


def subscribed_batch(
    reply: pb.SubscribeResponse, device: torch.device | str | None
) -> SubscribedBatch:
    """A SubscribeResponse decoded and landed like any experience (see `land`)."""
    return SubscribedBatch(
        experience=land(experience_from_proto(reply.experience), device),
        batch_index=reply.batch_index,
        epoch=reply.epoch,
        step=reply.step,
    )
