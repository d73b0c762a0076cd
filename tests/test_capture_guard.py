"""server/capture_guard.py: a CUDA graph capture and a weight update's device work never overlap,
and an update does not hold the guard while it waits for its swap (the engine's running job may
be about to capture: holding it there would deadlock the two).

Off CUDA the guard is a no-op; here the server's update path is told its models are on CUDA
(its planes' device), so it takes the guard as on a GPU server, and a probe thread says whether
someone else holds it. The engine's side (runner.py, attention.py: each capture under the guard)
runs in the gpu tests that capture.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers_weights import (
    in_place_updates,
    perturbed,
    state_hash,
    tiny_llama,
    update_weights_requests,
)
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.server import capture_guard
from rollserve.server.capture_guard import apart_from_captures, captures_now

WAIT_S = 30.0
CUDA = torch.device("cuda")  # a device name: nothing runs there


def held_by_another_thread() -> bool:
    """Whether the guard is held by a thread other than a fresh probe thread."""
    free: list[bool] = []

    def probe() -> None:
        acquired = capture_guard._LOCK.acquire(blocking=False)
        if acquired:
            capture_guard._LOCK.release()
        free.append(acquired)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join(WAIT_S)
    return not free[0]


def test_the_guard_excludes_other_threads_for_cuda_work_only() -> None:
    with apart_from_captures(torch.device("cpu")):
        assert not held_by_another_thread()
    with apart_from_captures(CUDA):
        assert held_by_another_thread()
        with apart_from_captures(CUDA):  # reentrant: a plane's exit inside an update's hold
            assert held_by_another_thread()
    assert not held_by_another_thread()


def test_a_capture_never_waits_for_an_update_on_a_requests_path() -> None:
    """captures_now(wait=False): the engine's step captures only while no update holds the
    guard (else it has run eagerly, and captures at a later use); the warm-up waits."""
    with captures_now(torch.device("cpu"), wait=False) as now:
        assert now
    with captures_now(CUDA, wait=False) as now:
        assert now and held_by_another_thread()
    held, release = threading.Event(), threading.Event()

    def update() -> None:
        with apart_from_captures(CUDA):
            held.set()
            release.wait(WAIT_S)

    updating = threading.Thread(target=update)
    updating.start()
    try:
        assert held.wait(WAIT_S)
        with captures_now(CUDA, wait=False) as now:
            assert not now
    finally:
        release.set()
        updating.join(WAIT_S)
    with captures_now(CUDA, wait=True) as now:
        assert now
    assert not held_by_another_thread()


def test_an_update_holds_it_while_it_receives_and_not_while_it_waits_for_its_swap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, trainer = tiny_llama(0), tiny_llama(1)
    seen: dict[str, bool] = {}

    def at_swap() -> None:
        seen["swap"] = held_by_another_thread()

    def requests():
        for index, message in enumerate(update_weights_requests(trainer, version=1, mode="full")):
            if index == 1:  # the header read, the first chunk asked for: receiving
                seen["receive"] = held_by_another_thread()
            yield message

    updates = in_place_updates(model, before_apply=at_swap)
    monkeypatch.setattr(updates.planes, "device", CUDA)  # as a CUDA server's
    assert updates.update(requests()).version == 1
    assert seen == {"receive": True, "swap": False}
    assert not held_by_another_thread()  # given back after the update
    assert state_hash(model) == state_hash(trainer)
    # A refused update gives it back too.
    bad = perturbed(model, seed=2)
    bad["lm_head.weight"][0, 0] = float("nan")
    with pytest.raises(InvalidArgument, match="lm_head.weight"):
        updates.update(update_weights_requests(bad, version=2, mode="full"))
    assert not held_by_another_thread()
