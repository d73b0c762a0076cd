"""The engine's worker thread: ordering, bounded queue, streaming, errors and cancellation."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from helpers_wait import wait_until
from rollserve.client.protocol.errors import FailedPrecondition, ResourceExhausted, Unavailable
from rollserve.server.engine.worker import Engine


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine(max_queue_depth=2)
    yield engine
    engine.close()


def test_jobs_run_in_order_on_one_thread(engine: Engine) -> None:
    seen: list[tuple[int, str]] = []
    futures = [
        engine.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
        for i in range(2)
    ]
    for future in futures:
        future.result(timeout=5)
    assert [i for i, _ in seen] == [0, 1]
    assert {name for _, name in seen} == {"rollserve-engine"}


def test_full_queue_is_resource_exhausted(engine: Engine) -> None:
    release = threading.Event()
    started = threading.Event()

    def block() -> None:
        started.set()
        release.wait(5)

    running = engine.submit(block)
    started.wait(5)
    queued = [engine.submit(lambda: None) for _ in range(2)]
    assert engine.queue_depth == 2
    with pytest.raises(ResourceExhausted, match="queue is full"):
        engine.submit(lambda: None)
    release.set()
    for future in [running, *queued]:
        future.result(timeout=5)
    assert engine.queue_depth == 0


def test_stream_yields_items_and_reraises(engine: Engine) -> None:
    def produce() -> Iterator[int]:
        yield 1
        yield 2
        raise FailedPrecondition("stale")

    stream = engine.stream(produce)
    assert next(stream) == 1
    assert next(stream) == 2
    with pytest.raises(FailedPrecondition, match="stale"):
        next(stream)


def test_abandoned_stream_stops_the_producer(engine: Engine) -> None:
    produced: list[int] = []
    gate = threading.Event()

    def produce() -> Iterator[int]:
        for i in range(1000):
            produced.append(i)
            yield i
            gate.wait(0.01)

    stream = engine.stream(produce)
    assert next(stream) == 0
    stream.close()  # the consumer goes away (e.g. the client cancelled)
    engine.call(lambda: None, timeout_s=5)  # the worker is free again
    assert len(produced) < 1000


def test_closed_engine_refuses_jobs() -> None:
    engine = Engine()
    engine.close()
    with pytest.raises(Unavailable):
        engine.submit(lambda: None)


def test_call_then_returns_before_the_follow_up_which_runs_before_later_jobs(
    engine: Engine,
) -> None:
    follow_up_may_end = threading.Event()
    order: list[str] = []

    def follow_up(result: int) -> None:
        order.append(f"then {result}")
        follow_up_may_end.wait(5)

    # call_then returns while the follow-up is still blocked: the caller does not wait for it.
    assert engine.call_then(lambda: 7, follow_up) == 7
    later = engine.submit(lambda: order.append("later job"))
    assert not later.done()
    follow_up_may_end.set()
    later.result(timeout=5)
    assert order == ["then 7", "later job"]


def test_call_then_reraises_and_skips_the_follow_up(engine: Engine) -> None:
    followed: list[object] = []

    def fail() -> int:
        raise FailedPrecondition("no")

    with pytest.raises(FailedPrecondition, match="no"):
        engine.call_then(fail, followed.append)
    engine.call(lambda: None)  # the worker is still alive
    assert followed == []


def test_a_failing_follow_up_is_logged_not_raised(engine: Engine, caplog) -> None:
    def broken(_: int) -> None:
        raise RuntimeError("probe exploded")

    assert engine.call_then(lambda: 3, broken) == 3
    assert engine.call(lambda: "alive") == "alive"
    assert "probe exploded" in caplog.text


def _hold(engine: Engine) -> threading.Event:
    """Block the worker until the returned event is set (after the job has started)."""
    gate, started = threading.Event(), threading.Event()
    engine.submit(lambda: (started.set(), gate.wait(30)))
    assert started.wait(30)
    return gate


def _queue_keyed(engine: Engine, order: list[str], name: str, key: str) -> threading.Thread:
    """call_then(job `name`, follow-up `then name`, key) from a thread of its own (it blocks
    until its job has run)."""
    thread = threading.Thread(
        target=engine.call_then,
        args=(lambda: order.append(name), lambda _: order.append(f"then {name}")),
        kwargs=dict(key=key),
    )
    thread.start()
    return thread


def _wait_for_depth(engine: Engine, depth: int) -> None:
    wait_until(lambda: engine.queue_depth == depth, f"queue depth {depth}", within_s=30)


def test_a_keyed_follow_up_is_replaced_by_a_newer_one_before_the_next_job() -> None:
    # Two updates of one role back to back, then an experience job: the first update's probe
    # never runs (its weights were replaced before anything used them), the second's runs
    # before the job; another role's probe is kept, in the order the swaps came.
    engine = Engine(follow_up_idle_s=60)  # only a job may flush them here
    try:
        order: list[str] = []
        gate = _hold(engine)
        threads = []
        for depth, (name, key) in enumerate(
            [("actor v1", "actor"), ("critic v1", "critic"), ("actor v2", "actor")], start=1
        ):
            threads.append(_queue_keyed(engine, order, name, key))
            _wait_for_depth(engine, depth)
        job = engine.submit(lambda: order.append("experience"))
        gate.set()
        job.result(timeout=30)
        for thread in threads:
            thread.join(30)
        assert order == [
            "actor v1", "critic v1", "actor v2", "then critic v1", "then actor v2", "experience"
        ]  # fmt: skip
    finally:
        engine.close()


def test_an_idle_engine_runs_a_waiting_follow_up_by_itself() -> None:
    engine = Engine(follow_up_idle_s=0.01)
    try:
        ran = threading.Event()
        assert engine.call_then(lambda: 5, lambda result: ran.set(), key="actor") == 5
        assert ran.wait(30), "the follow-up never ran on an idle engine"
    finally:
        engine.close()


def test_a_keyed_follow_up_that_fails_is_logged_and_the_job_after_it_runs(caplog) -> None:
    engine = Engine(follow_up_idle_s=60)
    try:

        def broken(_: int) -> None:
            raise RuntimeError("probe exploded")

        assert engine.call_then(lambda: 3, broken, key="actor") == 3
        assert engine.call(lambda: "alive", timeout_s=30) == "alive"
        assert "probe exploded" in caplog.text
    finally:
        engine.close()
