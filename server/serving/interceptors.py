"""Server interceptors: telemetry (request ids, one access-log line and metrics per RPC) and auth.

Both wrap the real method handler in one of the same kind (unary or streaming on either side),
so they see every call, including the ones they refuse, and never change what a handler sends.
Order on the server: telemetry outermost, so a call refused by auth is still logged and counted.

Access log: one line per RPC on the logger "rollserve.access", as key=value pairs:

  rpc method=rollserve.v1.Rollout/MakeExperience status=OK duration_ms=812.4
      peer=ipv4:10.0.0.7:50712 request_id=3f9c... request_bytes=61 response_bytes=90311 responses=4

Limits (CallLimitInterceptor): at most --max-workers calls other than the probes (Rollout/Health
and grpc.health.v1 Check) run at once, and one more is RESOURCE_EXHAUSTED at once; the server's
pool has PROBE_THREADS threads beyond that, so a probe answers while every other slot is held
(by readers that never read, say). A response stream whose reader does not take a message
within --stream-send-timeout-s is ended DEADLINE_EXCEEDED, which frees its handler thread. The
same interceptor counts the Rollout calls whose handler has not returned (`in_flight`): what a
stop waits for (app.py).

Standard health checks and reflection log at DEBUG (a probe every few seconds is noise at INFO).
The request id is the caller's `x-request-id` metadata, else the MakeExperienceRequest.request_id
field, else a fresh one; it is echoed as `x-request-id` in the initial and trailing metadata.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ...client.protocol.errors import InvalidArgument, ResourceExhausted
from .metrics import ServerMetrics, split_method
from .security import OPEN_SERVICES, AuthTokens, authorize

__all__ = [
    "PROBE_METHODS",
    "PROBE_THREADS",
    "REQUEST_ID_KEY",
    "AuthInterceptor",
    "CallLimitInterceptor",
    "InFlight",
    "SendDeadlines",
    "MalformedRequestInterceptor",
    "TelemetryInterceptor",
]

_ACCESS_LOG = logging.getLogger("rollserve.access")
REQUEST_ID_KEY = "x-request-id"
# Ids from callers end up in logs (quoted when needed) and metadata: short printable ASCII.
_REQUEST_ID_RE = re.compile(r"^[\x20-\x7e]{1,128}$")
_Behavior = Callable[..., Any]


class _Call:
    """What one RPC did, filled in while it runs (only its own handler thread touches it)."""

    def __init__(self, method: str, request_id: str | None) -> None:
        self.method = method
        self.request_id = request_id
        self.received_bytes = 0
        self.sent_bytes = 0
        self.responses = 0
        self.started_s = time.perf_counter()

    def deserializer(self, inner: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
        def deserialize(data: bytes) -> Any:
            self.received_bytes += len(data)
            return data if inner is None else inner(data)

        return deserialize

    def serializer(self, inner: Callable[[Any], bytes] | None) -> Callable[[Any], bytes]:
        # Counting here costs nothing extra: grpc serializes each response exactly once anyway.
        def serialize(message: Any) -> bytes:
            data = message if inner is None else inner(message)
            self.sent_bytes += len(data)
            self.responses += 1
            return data

        return serialize

    def count_sent(self, message: Any) -> None:
        size = len(message) if isinstance(message, bytes) else getattr(message, "ByteSize", None)
        self.sent_bytes += size() if callable(size) else int(size or 0)
        self.responses += 1


_Wrap = Callable[[_Behavior], _Behavior]


def _rewrap(
    handler: grpc.RpcMethodHandler,
    *,
    unary_out: _Wrap,
    stream_out: _Wrap,
    request_deserializer: Callable[[bytes], Any] | None = None,
    response_serializer: Callable[[Any], bytes] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler`, its behavior wrapped by `unary_out` when it
    returns one response, by `stream_out` when it yields a stream of them."""
    deserializer = request_deserializer or handler.request_deserializer
    serializer = response_serializer or handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            stream_out(handler.stream_stream), deserializer, serializer
        )
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(
            unary_out(handler.stream_unary), deserializer, serializer
        )
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            stream_out(handler.unary_stream), deserializer, serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        unary_out(handler.unary_unary), deserializer, serializer
    )


class TelemetryInterceptor(grpc.ServerInterceptor):
    """Request ids, the access log and the RPC metrics."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED; nothing to label
            return None
        metadata = handler_call_details.invocation_metadata or ()
        call = _Call(handler_call_details.method, _caller_request_id(metadata))
        serializer = handler.response_serializer
        if handler.response_streaming:
            serializer = call.serializer(serializer)
        return _rewrap(
            handler,
            unary_out=functools.partial(self._unary, call),
            stream_out=functools.partial(self._stream, call),
            request_deserializer=call.deserializer(handler.request_deserializer),
            response_serializer=serializer,
        )

    def _stream(self, call: _Call, behavior: _Behavior) -> _Behavior:
        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._begin(call, request)
            try:
                _echo_request_id(call, context)
                yield from behavior(request, context)  # closing this closes the handler's too
            except BaseException:  # GeneratorExit too: the client went away
                self._end(call, context, raised=True)
                raise
            self._end(call, context, raised=False)

        return stream

    def _unary(self, call: _Call, behavior: _Behavior) -> _Behavior:
        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            self._begin(call, request)
            try:
                _echo_request_id(call, context)
                response = behavior(request, context)
            except BaseException:
                self._end(call, context, raised=True)
                raise
            # grpc serializes a unary response only after this returns: size it here (the unary
            # responses of this server are small; streamed ones are counted as serialized).
            call.count_sent(response)
            self._end(call, context, raised=False)
            return response

        return unary

    def _begin(self, call: _Call, request: Any) -> None:
        call.started_s = time.perf_counter()
        if call.request_id is None:
            field = getattr(request, "request_id", "")  # MakeExperienceRequest has one
            valid = isinstance(field, str) and _REQUEST_ID_RE.match(field)
            call.request_id = field if valid else uuid.uuid4().hex
        self._metrics.rpc_in_flight.labels(*split_method(call.method)).inc()

    def _end(self, call: _Call, context: grpc.ServicerContext, *, raised: bool) -> None:
        duration_s = time.perf_counter() - call.started_s
        code = _final_code(context, raised).name
        self._metrics.rpc_in_flight.labels(*split_method(call.method)).dec()
        self._metrics.observe_rpc(call.method, code, duration_s)
        self._metrics.observe_bytes(call.method, call.received_bytes, call.sent_bytes)
        service = split_method(call.method)[0]
        level = logging.DEBUG if service in OPEN_SERVICES else logging.INFO
        if not _ACCESS_LOG.isEnabledFor(level):
            return
        fields: dict[str, object] = {
            "method": call.method.lstrip("/"),
            "status": code,
            "duration_ms": round(duration_s * 1e3, 1),
            "peer": context.peer(),
            "request_id": call.request_id,
            "request_bytes": call.received_bytes,
            "response_bytes": call.sent_bytes,
            "responses": call.responses,
        }
        details = context.details() if code != "OK" else None
        if details:
            fields["details"] = details.decode("utf-8", "replace")
        _ACCESS_LOG.log(level, "rpc %s", _key_values(fields))


def _echo_request_id(call: _Call, context: grpc.ServicerContext) -> None:
    # Initial metadata reaches a streaming client before the first message; trailing metadata
    # reaches every client, refused calls included. Raises if the client already left.
    echo = ((REQUEST_ID_KEY, call.request_id or ""),)
    context.set_trailing_metadata(echo)
    context.send_initial_metadata(echo)


def _caller_request_id(metadata: tuple[tuple[str, Any], ...]) -> str | None:
    for key, value in metadata:
        if key == REQUEST_ID_KEY and isinstance(value, str) and _REQUEST_ID_RE.match(value):
            return value
    return None


def _final_code(context: grpc.ServicerContext, raised: bool) -> grpc.StatusCode:
    """The status the client gets (as far as the server knows it when the handler ends)."""
    code = context.code()
    if not context.is_active() or code is grpc.StatusCode.CANCELLED:
        remaining_s = context.time_remaining()
        if remaining_s is not None and remaining_s <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED  # grpc cancels the call at its deadline
        if code is None:
            return grpc.StatusCode.CANCELLED
    if code is not None:
        return code
    return grpc.StatusCode.UNKNOWN if raised else grpc.StatusCode.OK


def _key_values(fields: dict[str, object]) -> str:
    # Quote (as JSON strings) only values that would otherwise break the key=value split.
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\n\t'):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the token their method needs (security.authorize decides)."""

    def __init__(self, tokens: AuthTokens) -> None:
        self._tokens = tokens

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or not self._tokens.enabled:
            return handler
        metadata = tuple(handler_call_details.invocation_metadata or ())
        refusal = authorize(self._tokens, handler_call_details.method, metadata)
        if refusal is None:
            return handler

        # The real behavior never runs: not even a request stream is read.
        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(refusal.code, refusal.message)  # the code of errors.py's table

        return _rewrap(handler, unary_out=lambda _: refuse, stream_out=lambda _: refuse)


class _Undecodable:
    """Stands for a request message whose bytes did not parse (the deserializer raised)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    """Request bytes that do not parse are INVALID_ARGUMENT, not grpc's INTERNAL.

    grpc answers a request whose deserializer raises with INTERNAL "Exception deserializing
    request!", which says "server bug" for what is a client error (the fuzz campaign sent random
    and bit-flipped bytes to every method: tests/test_fuzz.py). Here the deserializer never
    raises; it returns a marker, and the call is aborted with INVALID_ARGUMENT naming the
    message type before the real behavior sees it (for a request stream: when it reaches the
    bad message). Innermost of the interceptors, so telemetry still counts and logs the call.
    """

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        deserializer = _tolerant(handler.request_deserializer)
        if handler.request_streaming:
            return _rewrap(
                handler,
                unary_out=_checking_stream_requests,
                stream_out=_checking_stream_requests,
                request_deserializer=deserializer,
            )
        return _rewrap(
            handler,
            unary_out=_checking_unary_request,
            stream_out=_checking_unary_request_stream,
            request_deserializer=deserializer,
        )


def _tolerant(inner: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    message_type = getattr(getattr(inner, "__self__", None), "DESCRIPTOR", None)
    name = message_type.full_name if message_type is not None else "the request message"

    def deserialize(data: bytes) -> Any:
        try:
            return inner(data)
        except Exception as error:  # protobuf's DecodeError, or anything a parser raises
            return _Undecodable(f"request: the bytes do not parse as {name} ({error})")

    return deserialize


def _abort_if_undecodable(request: Any, context: grpc.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        error = InvalidArgument(request.reason)  # the code of errors.py's table
        context.abort(error.code, error.message)


def _checking_unary_request(behavior: _Behavior) -> _Behavior:
    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        _abort_if_undecodable(request, context)
        return behavior(request, context)

    return unary


def _checking_unary_request_stream(behavior: _Behavior) -> _Behavior:
    def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        _abort_if_undecodable(request, context)
        yield from behavior(request, context)

    return stream


def _checking_stream_requests(behavior: _Behavior) -> _Behavior:
    def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        def checked() -> Iterator[Any]:
            for request in requests:
                _abort_if_undecodable(request, context)
                yield request

        return behavior(checked(), context)

    return call


# ---- limits: calls at once, and how long a reader may leave a message untaken ------------------

# The calls a load balancer or Kubernetes probe makes: outside the --max-workers limit, with
# threads of their own (they are unary and answer from memory, so a few threads serve many).
PROBE_METHODS = frozenset({"/rollserve.v1.Rollout/Health", "/grpc.health.v1.Health/Check"})
PROBE_THREADS = 4


class SendDeadlines:
    """Ends a response stream whose reader does not take a message within `timeout_s`.

    gRPC's sync server sends a streamed message from the handler's thread and waits until the
    transport took it; a client that never reads (its flow-control window full) would hold that
    thread for the life of the call. The stream arms a deadline before handing a message over
    and disarms it once gRPC asks for the next; one daemon thread cancels the calls whose
    deadline passed, with DEADLINE_EXCEEDED, and the handler's send returns at once.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._armed: dict[object, tuple[float, grpc.ServicerContext]] = {}
        self._closed = False
        self.expired = 0  # streams ended so far (tests and logs)
        self._thread = threading.Thread(target=self._run, name="send-deadlines", daemon=True)
        self._thread.start()

    def arm(self, key: object, context: grpc.ServicerContext) -> None:
        with self._cond:
            self._armed[key] = (time.monotonic() + self.timeout_s, context)
            if len(self._armed) == 1:
                self._cond.notify()

    @property
    def armed(self) -> int:
        """Streams whose message gRPC holds now (a reader that does not read keeps it)."""
        with self._cond:
            return len(self._armed)

    def disarm(self, key: object) -> None:
        with self._cond:
            self._armed.pop(key, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                expired = self._wait_for_expired()
                if expired is None:
                    return
            for context in expired:
                _end_call(
                    context,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the client took no message for {self.timeout_s:g} s "
                    "(--stream-send-timeout-s); the stream is ended",
                )

    def _wait_for_expired(self) -> list[grpc.ServicerContext] | None:
        """The contexts whose deadline passed (removed); None once closed. Holds the lock."""
        while not self._closed:
            now = time.monotonic()
            expired = [key for key, (deadline, _) in self._armed.items() if deadline <= now]
            if expired:
                self.expired += len(expired)
                return [self._armed.pop(key)[1] for key in expired]
            soonest = min((deadline for deadline, _ in self._armed.values()), default=None)
            self._cond.wait(None if soonest is None else soonest - now)
        return None


def _end_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """Cancel a call from outside its handler's thread, with `code` and `details` as its status.

    grpc's public cancel() always reports CANCELLED; its core call takes a status, so the
    client learns why. Falls back to cancel() where the core call is not reachable."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(code.value[0], details)  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        context.cancel()


class _Slots:
    """At most `limit` holders at once; taking never waits (a waiting call holds a thread)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self.held = 0

    def take(self) -> bool:
        with self._lock:
            if self.held >= self.limit:
                return False
            self.held += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self.held -= 1


# The calls whose handlers do the server's work (the probes aside): a stop waits for these; a
# grpc.health.v1 Watch or a reflection stream is no work left undone.
_WORK_PREFIX = "/rollserve.v1.Rollout/"


class InFlight:
    """How many work calls' handlers are running, and a wait until none is."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.count = 0

    def enter(self) -> None:
        with self._cond:
            self.count += 1

    def leave(self) -> None:
        with self._cond:
            self.count -= 1
            if self.count == 0:
                self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every handler returned within `timeout_s` (at once when none runs)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.count == 0, max(timeout_s, 0.0))


class CallLimitInterceptor(grpc.ServerInterceptor):
    """At most `max_calls` calls other than PROBE_METHODS at once (one more is
    RESOURCE_EXHAUSTED at once), every response stream under `deadlines`, and the Rollout calls
    whose handler is running counted in `in_flight`.

    Sits inside auth (a refused caller holds no slot) and outside the undecodable-request
    check. The server's pool has max_calls + PROBE_THREADS threads, so probes find one free.
    """

    def __init__(self, max_calls: int, deadlines: SendDeadlines) -> None:
        self.slots = _Slots(max_calls)
        self.in_flight = InFlight()
        self._deadlines = deadlines

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in PROBE_METHODS:
            return handler
        counted = self.in_flight if handler_call_details.method.startswith(_WORK_PREFIX) else None
        return _rewrap(
            handler,
            unary_out=functools.partial(self._unary, counted),
            stream_out=functools.partial(self._stream, counted),
        )

    def _refuse(self, context: grpc.ServicerContext) -> None:
        error = ResourceExhausted(
            f"the server is serving {self.slots.limit} calls, its limit (--max-workers); "
            "retry later"
        )
        context.abort(error.code, error.message)

    def _unary(self, counted: InFlight | None, behavior: _Behavior) -> _Behavior:
        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            if not self.slots.take():
                self._refuse(context)
            with _counted(counted):
                try:
                    return behavior(request, context)
                finally:
                    self.slots.give_back()

        return unary

    def _stream(self, counted: InFlight | None, behavior: _Behavior) -> _Behavior:
        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if not self.slots.take():
                self._refuse(context)
            key = object()
            with _counted(counted):
                responses = behavior(request, context)
                try:
                    for response in responses:
                        # Armed while gRPC holds the message: it asks for the next one only
                        # once the transport took this one.
                        self._deadlines.arm(key, context)
                        try:
                            yield response
                        finally:
                            self._deadlines.disarm(key)
                finally:
                    close = getattr(responses, "close", None)
                    if close is not None:
                        close()  # the handler's own cleanup runs now, not when collected
                    self.slots.give_back()

        return stream


@contextlib.contextmanager
def _counted(in_flight: InFlight | None) -> Iterator[None]:
    if in_flight is None:
        yield
        return
    in_flight.enter()
    try:
        yield
    finally:
        in_flight.leave()
