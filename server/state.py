"""Phase and ServerState: the life cycle of a server, and the one holder of policy versions.

The servicer, the health checks, the metrics, the engine's jobs and the continuous rollout all
read the same ServerState; only the weight updater (weights/update.py) writes a version, on the
engine thread between batches. ServerState knows nothing of the engine: the queue depth it
reports comes from a callable the engine's owner hands it (`watch_queue`).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

from .algorithms import DEFAULT_PRESET
from .config import ServerConfig
from .models import ModelSet

__all__ = ["Phase", "ServerState"]


class Phase(enum.Enum):
    """Life cycle of a server; mirrors the wire enum ServingStatus."""

    LOADING = "loading"
    SERVING = "serving"
    WAITING_FOR_WEIGHTS = "waiting_for_weights"
    DRAINING = "draining"


class ServerState:
    """What the servicer, the health checks and the engine share: thread-safe."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.models: ModelSet | None = None  # None while loading
        self._started_s = time.monotonic()
        self._lock = threading.Lock()
        self._phase = Phase.LOADING
        self._versions: dict[str, int] = {}
        self._listeners: list[Callable[[Phase], None]] = []
        self._queue_depth: Callable[[], int] = lambda: 0  # no engine yet

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started_s

    def on_phase_change(self, listener: Callable[[Phase], None]) -> None:
        """Call `listener(phase)` on every change (used to mirror grpc.health.v1)."""
        with self._lock:
            self._listeners.append(listener)

    def set_phase(self, phase: Phase) -> None:
        """Move to `phase`; DRAINING is final so a late "ready" cannot undo a shutdown."""
        with self._lock:
            if self._phase is Phase.DRAINING or self._phase is phase:
                return
            self._phase = phase
            listeners = list(self._listeners)
        for listener in listeners:
            listener(phase)

    def set_models(self, models: ModelSet) -> None:
        with self._lock:
            self.models = models
            self._versions = {model.role: 0 for model in models.loaded()}

    def policy_version(self, role: str = "actor") -> int:
        """Version of a role's weights: 0 until the first update (and for roles not loaded)."""
        with self._lock:
            return self._versions.get(role, 0)

    def set_policy_version(self, role: str, version: int) -> None:
        with self._lock:
            self._versions[role] = version

    def watch_queue(self, depth: Callable[[], int]) -> None:
        """Report `depth()` as the number of requests waiting for the engine from now on."""
        self._queue_depth = depth

    def queue_depth(self) -> int:
        """Requests waiting for the engine; 0 until the engine exists."""
        return self._queue_depth()

    @property
    def default_preset(self) -> str:
        """The preset of requests that name none: the flag, else the algorithms' default."""
        return self.config.default_preset or DEFAULT_PRESET
