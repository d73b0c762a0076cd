"""The engine: one worker thread owns the device and runs jobs one at a time, in order.

gRPC handler threads never touch the models; they submit jobs here. Because the worker runs
one job at a time, a weight swap (itself a job) always falls between two experience jobs:
every sample is made entirely by one version, and a MakeExperience in flight finishes on the
weights it started with.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TypeVar

from ...client.protocol.errors import Cancelled, ResourceExhausted, Unavailable

T = TypeVar("T")
log = logging.getLogger(__name__)

_DONE = object()


class Engine:
    """A bounded job queue in front of a single worker thread."""

    def __init__(self, *, max_queue_depth: int = 64, name: str = "rollserve-engine") -> None:
        if max_queue_depth < 1:
            raise ValueError("max_queue_depth must be >= 1")
        self._jobs: queue.Queue[tuple[Callable[[], object], Future] | None] = queue.Queue()
        self._max_queue_depth = max_queue_depth
        self._waiting = 0
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Jobs submitted and not yet started."""
        return self._waiting

    @property
    def stopped(self) -> bool:
        """Whether the worker thread has exited (after `close`)."""
        return not self._thread.is_alive()

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Queue `job` for the worker; ResourceExhausted when the queue is full."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise Unavailable("the server is shutting down")
            if self._waiting >= self._max_queue_depth:
                raise ResourceExhausted(
                    f"request queue is full ({self._waiting} waiting); retry later"
                )
            self._waiting += 1
            self._jobs.put((job, future))
        return future

    def call(self, job: Callable[[], T], *, timeout_s: float | None = None) -> T:
        """Run `job` on the worker and wait for its result (its exception is re-raised)."""
        return self.submit(job).result(timeout=timeout_s)

    def call_then(self, job: Callable[[], T], then: Callable[[T], object]) -> T:
        """Run `job` on the worker and return its result as soon as it has one; the worker then
        runs `then(result)` before any later job.

        For work that must follow `job` before anything else uses the device, but that the caller
        need not wait for (the readiness probe of new weights). `then`'s own errors are logged.
        """
        early: Future[T] = Future()

        def job_then() -> None:
            try:
                result = job()
            except BaseException as error:
                early.set_exception(error)
                raise
            early.set_result(result)
            try:
                then(result)
            except Exception:
                log.exception("the follow-up of an engine job failed")

        future = self.submit(job_then)
        wait((early, future), return_when=FIRST_COMPLETED)
        return early.result() if early.done() else future.result()  # type: ignore[return-value]

    def stream(
        self, produce: Callable[[], Iterator[T]], *, cancelled: threading.Event | None = None
    ) -> Iterator[T]:
        """Run the generator `produce()` on the worker, yielding its items here as they come.

        Setting `cancelled` (or abandoning this iterator) stops the producer at its next item,
        so a cancelled request stops using the device.
        """
        cancelled = cancelled or threading.Event()
        items: queue.SimpleQueue[object] = queue.SimpleQueue()

        def job() -> None:
            try:
                for item in produce():
                    if cancelled.is_set():
                        raise Cancelled("the request was cancelled")
                    items.put(item)
            finally:
                items.put(_DONE)

        future = self.submit(job)
        try:
            while (item := items.get()) is not _DONE:
                yield item  # type: ignore[misc]
            future.result()  # re-raise the producer's exception, if any
        finally:
            cancelled.set()

    def close(self, *, wait: bool = True, timeout_s: float | None = None) -> None:
        """Refuse new jobs; the worker finishes the queued ones, then exits."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)
        if wait:
            self._thread.join(timeout_s)

    def _work(self) -> None:
        while (entry := self._jobs.get()) is not None:
            job, future = entry
            with self._lock:
                self._waiting -= 1
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as error:  # the submitter decides what to do with it
                future.set_exception(error)
