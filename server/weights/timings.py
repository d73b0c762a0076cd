"""Where one weight update's time goes on the server: phases in order, and lane-seconds.

An update is a sequence on its handler thread (the engine thread runs `apply` while the handler
waits for it), so its phases are *laps*: `lap(phase)` charges the time since the previous lap
to `phase`. Work that runs on several lanes at once is summed per kind in `add`, with how many
times it ran (lane-seconds: with four lanes they can exceed the phase that holds them). The
update logs `line()` at INFO, one line per update, and hands `phases` to an observer (the
server's metrics: rollserve_update_phase_seconds).

The lane-seconds: stream_wait (a gRPC stream waiting for its next chunk: the network),
writer_wait (shm lanes waiting for the client's writes), broadcast_wait (dist), ring_wait,
host_copy and copy_launch (a device arena's pinned ring: ring_wait and copy_launch per slot,
waiting for a free slot and launching its host-to-device copy; host_copy per piece copied into a
slot, several per slot when small chunks fill one; copy_launch also per device piece),
check_group (per value-check reduction launched, once its tensors' bytes were all copied),
page_lock (shm into a CUDA arena: registering the client's mapping, once per mapping),
ipc_event_wait, ipc_handle_open and ipc_handle_close (per CUDA IPC buffer opened or closed;
ipc_handle_kept counts those found open from an earlier update, cuda_ipc.py), head_check (the
head parsed and planned against the model; absent when the arena's last head was reused),
arena_take (absent when staged in place), in_place (the data section staged where a plane
holds it, stream.py: its checks launched, once),
finish_sync and settle (finish's wait and its verdict), apply_resolve, apply_launch (per tensor
copied) and apply_wait.

The phases (those a plane does not have stay absent):

    header       the first message read and its data plane picked
    turn         waiting for the update turn (another update streaming)
    head         the file's head arrived and was verified, the arena taken
    open         the plane's source opened (CUDA IPC handles, a shared-memory mapping)
    receive      the bytes received into the arena (for a device arena: their copies issued)
    finish       the one wait for the copies and value checks, then their verdict
    swap_wait    the verified update waiting for its turn on the engine thread
    apply        the copies into the live weights (and their wait)
    swap_return  from the end of apply until the handler thread runs again
    close        the arena's lease ended and the plane closed (CUDA IPC handles closed)
    reply        the reply built and the plane told
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

__all__ = ["PHASES", "PhaseObserver", "UpdateTimings", "waited"]

T = TypeVar("T")

PHASES = (
    "header",
    "turn",
    "head",
    "open",
    "receive",
    "finish",
    "swap_wait",
    "apply",
    "swap_return",
    "close",
    "reply",
)

# Called once per finished update with its phases (seconds); the server's metrics observe them.
PhaseObserver = Callable[[Mapping[str, float]], None]


class UpdateTimings:
    """The phases of one update (laps on its handler thread) and its lanes' summed seconds."""

    def __init__(self) -> None:
        self._started = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.lane_seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to `phase` (added if it ran before)."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def add(self, kind: str, seconds: float, count: int = 1) -> None:
        """Add `seconds` of one lane's work of `kind` (thread-safe), `count` times done."""
        with self._lock:
            self.lane_seconds[kind] = self.lane_seconds.get(kind, 0.0) + seconds
            self.counts[kind] = self.counts.get(kind, 0) + count

    @property
    def total_s(self) -> float:
        """From the first mark to the last lap."""
        return self._last - self._started

    def line(self) -> str:
        """The phases in order, then the lane-seconds (with how many times each ran)."""
        order = [p for p in PHASES if p in self.phases] + sorted(self.phases.keys() - set(PHASES))
        phases = " ".join(f"{p} {self.phases[p]:.4f}" for p in order)
        text = f"{phases} = {self.total_s:.4f} s"
        with self._lock:
            if self.lane_seconds:
                kinds = " ".join(
                    f"{k} {s:.4f}/{self.counts[k]}" for k, s in sorted(self.lane_seconds.items())
                )
                text += f"; lane-s/count: {kinds}"
        return text


def waited(items: Iterator[T], timings: UpdateTimings, kind: str) -> Iterator[T]:
    """`items`, adding the seconds spent waiting for each next one to `kind` (a stream's wait
    for the network, as opposed to the time spent on what arrived)."""
    waiting_s = 0.0
    count = 0
    try:
        while True:
            asked_s = time.perf_counter()
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                waiting_s += time.perf_counter() - asked_s
                count += 1
            yield item
    finally:
        timings.add(kind, waiting_s, count)
