"""The gRPC server's thread pool: at most `max_workers` threads, and a thread idle for `idle_s`
(IDLE_THREAD_S) ends.

grpc's sync server runs each call's handler on a thread of the executor it is given. The
standard ThreadPoolExecutor keeps every thread it ever started, so after a burst of held calls
(readers that never read, peer waits) the process kept --max-workers + PROBE_THREADS threads for
good. Here a thread that finds no work for `idle_s` ends, and the server goes back to its baseline
once the burst is over. The threads are daemon threads: an idle one must not hold the
interpreter's exit for `idle_s`, and a stuck one is the stop's business (app.py leaves the
process with exit code 4 rather than wait for it).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["IDLE_THREAD_S", "ShrinkingThreadPool"]

# Long enough that steady traffic reuses its threads, short enough that a burst's threads are
# gone soon after it.
IDLE_THREAD_S = 5.0
_T = TypeVar("_T")
_Work = tuple[Future, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class ShrinkingThreadPool(Executor):
    """A thread per piece of work up to `max_workers`, threads reused while work comes, and
    ended after `idle_s` without any."""

    def __init__(
        self, max_workers: int, *, idle_s: float = IDLE_THREAD_S, thread_name_prefix: str = "pool"
    ) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        self.max_workers = max_workers
        self._idle_s = idle_s
        self._prefix = thread_name_prefix
        self._numbers = itertools.count()
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0  # alive workers
        self._free = 0  # workers waiting for work (a spawn is due when work outnumbers them)
        self._queued = 0  # work put and not yet taken
        self._shut_down = False

    @property
    def threads(self) -> int:
        """Worker threads alive now."""
        with self._lock:
            return self._threads

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        future: Future[_T] = Future()
        with self._lock:
            # Work that still comes after shutdown (a call gRPC had already taken) runs too.
            self._work.put((future, fn, args, kwargs))
            self._queued += 1
            if self._queued > self._free and self._threads < self.max_workers:
                self._threads += 1
                self._free += 1  # it starts by waiting for work
                name = f"{self._prefix}_{next(self._numbers)}"
                threading.Thread(target=self._run, name=name, daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Idle threads end now, busy ones once their work is done, before the interpreter's
        exit (`wait` is not waited for: a stuck handler is the stop's business)."""
        with self._lock:
            self._shut_down = True  # a thread that finishes its work from now on ends
            for _ in range(self._threads):  # wakes the idle ones
                self._work.put(None)

    def _run(self) -> None:
        while True:
            try:
                work = self._work.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._queued == 0:  # still nothing (a submit holds the lock to put)
                        self._free -= 1
                        self._threads -= 1
                        return
                continue  # work came in the meantime: take it
            if work is None:  # shutdown
                with self._lock:
                    if self._queued == 0:
                        self._free -= 1
                        self._threads -= 1
                        return
                    # Work came after the shutdown: take it first, and keep the wake-up for
                    # whichever thread is idle next (a lost one would leave it idle for idle_s).
                    self._work.put(None)
                continue
            with self._lock:
                self._queued -= 1
                self._free -= 1
            future, fn, args, kwargs = work
            del work  # nothing of a finished call may stay referenced while this thread idles
            result: Any = None
            failure: BaseException | None = None
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as error:  # the submitter decides what it means
                    failure = error
            del fn, args, kwargs
            with self._lock:
                if self._shut_down and self._queued == 0:
                    ending = True  # no wake-up needed: end now rather than idle for idle_s
                    self._threads -= 1
                else:
                    ending = False
                    # Free before the submitter hears back, so its next work reuses this thread.
                    self._free += 1
            if future.running():
                if failure is None:
                    future.set_result(result)
                else:
                    future.set_exception(failure)
            del future, result, failure
            if ending:
                return
