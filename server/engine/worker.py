"""The engine: one worker thread owns the device and runs jobs one at a time, in order.

gRPC handler threads never touch the models; they submit jobs here. Because the worker runs
one job at a time, a weight swap (itself a job) always falls between two experience jobs:
every sample is made entirely by one version, and a MakeExperience in flight finishes on the
weights it started with.

Follow-ups (`call_then`): work that must follow a job before anything else uses the device,
but need not delay the job's caller (the readiness probe of new weights, after a swap). A
keyed follow-up waits: it runs before the next job that is not itself keyed (a swap), or once
the queue has stayed empty for FOLLOW_UP_IDLE_S; a later follow-up with the same key replaces
it. So updates pushed back to back pay no probe of weights that a newer update replaced before
anything was made on them, and nothing is made on weights whose probe has not run.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import NamedTuple, TypeVar

from ...client.protocol.errors import Cancelled, ResourceExhausted, Unavailable

T = TypeVar("T")
log = logging.getLogger(__name__)

_DONE = object()
# How long the worker waits for a next job before it runs the keyed follow-ups itself (the
# probe's verdict reaches Health at most this late). Covers the gap between two updates that a
# trainer sends back to back (its next prepare and transfer), not a wait for anything.
FOLLOW_UP_IDLE_S = 0.1


class _Entry(NamedTuple):
    job: Callable[[], object]
    future: Future
    keyed: bool  # submitted with a follow-up key: runs without flushing the waiting follow-ups


class Engine:
    """A bounded job queue in front of a single worker thread."""

    def __init__(
        self,
        *,
        max_queue_depth: int = 64,
        name: str = "rollserve-engine",
        follow_up_idle_s: float = FOLLOW_UP_IDLE_S,
    ) -> None:
        if max_queue_depth < 1:
            raise ValueError("max_queue_depth must be >= 1")
        self._jobs: queue.Queue[_Entry | None] = queue.Queue()
        # Keyed follow-ups not yet run, in the order they came; the worker's alone.
        self._follow_ups: dict[str, Callable[[], object]] = {}
        self._follow_up_idle_s = follow_up_idle_s
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
        return self._queue(job, keyed=False)

    def _queue(self, job: Callable[[], T], *, keyed: bool) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise Unavailable("the server is shutting down")
            if self._waiting >= self._max_queue_depth:
                raise ResourceExhausted(
                    f"request queue is full ({self._waiting} waiting); retry later"
                )
            self._waiting += 1
            self._jobs.put(_Entry(job, future, keyed))
        return future

    def call(self, job: Callable[[], T], *, timeout_s: float | None = None) -> T:
        """Run `job` on the worker and wait for its result (its exception is re-raised)."""
        return self.submit(job).result(timeout=timeout_s)

    def call_then(
        self, job: Callable[[], T], then: Callable[[T], object], *, key: str | None = None
    ) -> T:
        """Run `job` on the worker and return its result as soon as it has one; the worker then
        runs `then(result)` before any later job.

        For work that must follow `job` before anything else uses the device, but that the caller
        need not wait for (the readiness probe of new weights). With a `key`, `then` waits as the
        module says: before the next job that is not keyed, or after FOLLOW_UP_IDLE_S without a
        job, unless another keyed job's follow-up of the same key replaces it first. `then`'s
        own errors are logged.
        """
        early: Future[T] = Future()

        def job_then() -> None:
            try:
                result = job()
            except BaseException as error:
                early.set_exception(error)
                raise
            early.set_result(result)
            if key is None:
                self._run_follow_up(lambda: then(result))
            else:
                self._follow_ups.pop(key, None)  # the newest goes last
                self._follow_ups[key] = lambda: then(result)

        future = self._queue(job_then, keyed=key is not None)
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
        while (entry := self._next_entry()) is not None:
            with self._lock:
                self._waiting -= 1
            if not entry.keyed:
                self._run_follow_ups()
            if not entry.future.set_running_or_notify_cancel():
                continue
            try:
                entry.future.set_result(entry.job())
            except BaseException as error:  # the submitter decides what to do with it
                entry.future.set_exception(error)
            entry = None  # a finished job's closure must not live on while the worker waits
        if self._follow_ups:  # closing: nothing will use the device again
            log.debug("engine closed with %d follow-ups not run", len(self._follow_ups))
            self._follow_ups.clear()

    def _next_entry(self) -> _Entry | None:
        """The next job; while follow-ups wait, run them if none comes within the idle time."""
        if self._follow_ups:
            try:
                return self._jobs.get(timeout=self._follow_up_idle_s)
            except queue.Empty:
                self._run_follow_ups()
        return self._jobs.get()

    def _run_follow_ups(self) -> None:
        while self._follow_ups:
            key = next(iter(self._follow_ups))
            self._run_follow_up(self._follow_ups.pop(key))

    @staticmethod
    def _run_follow_up(follow_up: Callable[[], object]) -> None:
        try:
            follow_up()
        except Exception:
            log.exception("the follow-up of an engine job failed")
