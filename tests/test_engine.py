"""The engine's worker thread: ordering, bounded queue, streaming, errors and cancellation."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
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
