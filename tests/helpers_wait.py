"""Waiting in tests for a condition to hold, bounded by a deadline (never a fixed sleep).

The condition is polled every POLL_S; the bound is only reached when something is wrong, so
it can be generous on a loaded machine without slowing a passing run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

POLL_S = 0.01


def became_true(condition: Callable[[], bool], within_s: float) -> bool:
    """Whether `condition` held at some check within `within_s`."""
    deadline = time.monotonic() + within_s
    tick = threading.Event()  # never set: a wait that a signal cannot cut short
    while not condition():
        if time.monotonic() > deadline:
            return False
        tick.wait(POLL_S)
    return True


def wait_until(condition: Callable[[], bool], what: str, within_s: float) -> None:
    """Return once `condition` holds; AssertionError naming `what` after `within_s`."""
    if not became_true(condition, within_s):
        raise AssertionError(f"still not true after {within_s} s: {what}")
