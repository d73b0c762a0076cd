"""End a client stream that stalls: no request message for `idle_s` while the handler waits.

Why: an UpdateWeights stream holds the update lock and its staging memory until it ends. A
trainer that sends the header and part of the file and then hangs (a stuck process, a half-open
connection that TCP keepalive has not yet noticed) would otherwise block every later update and
keep the staging buffers forever. A call deadline is the client's choice, and a client that
stalls may have set none.

Only time spent waiting for the client counts: the clock runs while the handler is blocked in
`next()` on the request stream, not while it waits for the update lock or verifies a chunk. On
expiry a watchdog thread ends the call with DEADLINE_EXCEEDED and a message naming the flag; the
handler's pending `next()` then raises, so staging unwinds through its `with` blocks (update lock,
arena lease) and drops its buffers, exactly as for a client that cancels.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import grpc

__all__ = ["IdleDeadline"]

_LOG = logging.getLogger(__name__)
_T = TypeVar("_T")


class IdleDeadline:
    """`with IdleDeadline(context, idle_s, what) as deadline: handle(deadline.wrap(requests))`."""

    def __init__(self, context: grpc.ServicerContext, idle_s: float, what: str) -> None:
        self._context = context
        self._idle_s = idle_s
        self._what = what
        self._waiting_since: float | None = None  # set while the handler waits for a message
        self._done = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="rollserve-idle", daemon=True)
        self.expired = False

    def __enter__(self) -> IdleDeadline:
        self._watchdog.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._watchdog.join()

    def wrap(self, requests: Iterable[_T]) -> Iterator[_T]:
        """The same messages; the clock runs only inside each `next()`."""
        iterator = iter(requests)
        while True:
            self._waiting_since = time.monotonic()
            try:
                request = next(iterator)
            except StopIteration:
                return
            finally:
                self._waiting_since = None
            yield request

    def _watch(self) -> None:
        poll_s = min(self._idle_s / 4, 1.0)
        while not self._done.wait(poll_s):
            since = self._waiting_since
            if since is not None and time.monotonic() - since >= self._idle_s:
                self.expired = True
                message = (
                    f"{self._what}: no message for {self._idle_s:g} s; the stream was ended and "
                    "nothing was applied (--update-idle-timeout-s)"
                )
                _LOG.warning("%s", message)
                _end_call(self._context, message)
                return


def _end_call(context: Any, message: str) -> None:
    """Cancel the call so that the client gets DEADLINE_EXCEEDED with `message`.

    grpcio's public `context.cancel()` sends a bare CANCELLED; the status and message come from
    the core call underneath (grpcio's internal API, checked by tests/test_cut_streams.py), with
    the public cancel as the fallback should that ever move.
    """
    try:
        from grpc._cython import cygrpc

        context._rpc_event.call.cancel(cygrpc.StatusCode.deadline_exceeded, message)
    except Exception:  # an internal name changed: still end the call
        context.cancel()
