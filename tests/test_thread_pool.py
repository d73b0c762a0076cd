"""The server's thread pool (server/serving/thread_pool.py): work runs and returns through its
future, at most max_workers threads run, later work waits for a free one, and the threads a burst
started end once idle, back to none."""

from __future__ import annotations

import threading

import pytest
from helpers_wait import became_true
from rollserve.server.serving.thread_pool import ShrinkingThreadPool

WAIT_S = 10.0
IDLE_S = 0.2


def test_work_runs_and_its_result_or_error_comes_back() -> None:
    pool = ShrinkingThreadPool(2, idle_s=IDLE_S)
    assert pool.submit(lambda a, b=0: a + b, 2, b=3).result(WAIT_S) == 5
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(WAIT_S)


def test_a_burst_uses_at_most_max_workers_threads_and_they_end_once_idle() -> None:
    pool = ShrinkingThreadPool(4, idle_s=IDLE_S, thread_name_prefix="burst")
    release = threading.Event()
    started = threading.Semaphore(0)

    def held() -> int:
        started.release()
        release.wait(WAIT_S)
        return threading.get_ident()

    futures = [pool.submit(held) for _ in range(6)]
    for _ in range(4):
        assert started.acquire(timeout=WAIT_S)
    assert pool.threads == 4  # the other two wait for a free thread
    release.set()
    idents = {future.result(WAIT_S) for future in futures}
    assert len(idents) == 4  # the waiting work ran on threads that came free
    assert became_true(lambda: pool.threads == 0, WAIT_S)  # all idle for idle_s: gone
    assert not [t for t in threading.enumerate() if t.name.startswith("burst_")]
    assert pool.submit(lambda: "again").result(WAIT_S) == "again"  # a new thread when needed


def test_steady_work_reuses_a_thread() -> None:
    pool = ShrinkingThreadPool(4, idle_s=WAIT_S)
    idents = {pool.submit(threading.get_ident).result(WAIT_S) for _ in range(20)}
    assert len(idents) == 1 and pool.threads == 1


def test_shutdown_ends_idle_threads_now_and_later_work_still_runs() -> None:
    pool = ShrinkingThreadPool(3, idle_s=WAIT_S * 10)
    release = threading.Event()
    busy = pool.submit(release.wait, WAIT_S)
    assert pool.submit(lambda: 1).result(WAIT_S) == 1  # a second thread, idle now
    pool.shutdown(wait=False)
    # The idle one ended at once, not after idle_s.
    assert became_true(lambda: pool.threads == 1, WAIT_S)
    release.set()
    assert busy.result(WAIT_S) is True
    assert became_true(lambda: pool.threads == 0, WAIT_S)  # the busy one once its work was done
    assert pool.submit(lambda: 2).result(WAIT_S) == 2  # work gRPC had already taken runs
