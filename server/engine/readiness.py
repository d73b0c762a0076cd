"""Deep readiness: SERVING only once a tiny forward pass works on the weights being served.

Health names (grpc.health.v1): "" (the whole server, what Kubernetes and grpc_health_probe ask)
and "rollserve.v1.Rollout" report the same status: SERVING only after the start-up probe passed,
NOT_SERVING while loading, while waiting for the first weights (--wait-for-weights), after a
weight update whose probe failed, and from the start of a drain on.

The probe is a forward pass over two token ids on the engine thread (the one thread that uses
the device), checking that it returns finite outputs: it catches a broken device, a model that
does not run, and weights that produce NaN (e.g. an update sent with allow_non_finite). At start
it probes every loaded model, then warms the generation engine up (when the actor generates on
it: one dummy request of the server's default shape, so that compiling the decode step and
capturing its CUDA graphs happen before SERVING, on the thread where requests run). After an
update it probes the updated model on the engine, before any job that is not another swap
(Engine.call_then keyed by role), without delaying the update's reply: no experience is made on
weights that were not probed, and the verdict lands in the health status (at most
FOLLOW_UP_IDLE_S plus the probe after the swap, on an idle server) and in the phase that
MakeExperience jobs check on the engine. Updates pushed back to back probe only the weights
that are still there when something else needs the engine: a probe (an eager forward pass,
10-20 ms on a GPU) per update would otherwise sit in front of every next swap. A failed
post-update probe moves the server to WAITING_FOR_WEIGHTS (NOT_SERVING; MakeExperience answers
FAILED_PRECONDITION) until an update whose probe passes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from ..models import LoadedModel, ModelSet
from ..state import Phase, ServerState
from .worker import Engine

__all__ = ["Readiness", "ReadinessError", "probe_model"]

_LOG = logging.getLogger(__name__)


class ReadinessError(RuntimeError):
    """A model failed its readiness forward pass; the message names the role and the reason."""


def probe_model(model: LoadedModel, models: ModelSet) -> None:
    """Run a 2-token forward pass of `model`; ReadinessError unless its outputs are finite."""
    # Ids 1 and 2 exist in any vocabulary worth serving; the clamp covers degenerate test ones.
    ids = torch.tensor([[1, 2]], device=models.device).clamp(max=models.vocab_size - 1)  # (1, 2)
    try:
        with torch.inference_mode():
            output = model.module(input_ids=ids, attention_mask=torch.ones_like(ids))
        finite = bool(torch.isfinite(output.logits).all())
    except Exception as exc:  # any failure of the forward pass means "not ready"
        raise ReadinessError(f"{model.role} model failed a forward pass: {exc}") from exc
    if not finite:
        raise ReadinessError(f"{model.role} model produced non-finite outputs")


def _warm_up(warm_up: Callable[[], float | None]) -> None:
    try:
        seconds = warm_up()
    except Exception as exc:  # a generation engine that cannot run is not ready
        raise ReadinessError(f"the generation engine failed its warm-up: {exc}") from exc
    if seconds is not None:
        _LOG.info("generation engine warmed up in %.2f s", seconds)


class Readiness:
    """Runs the probes on the engine and moves the server's phase on their verdicts."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._lock = threading.Lock()
        self._failed_roles: set[str] = set()

    def check_startup(
        self, engine: Engine, warm_up: Callable[[], float | None] | None = None
    ) -> None:
        """Probe every loaded model on the engine thread, then run `warm_up` there (the
        maker's: the generation engine's KV cache, compiled step and CUDA graphs, built where
        requests run and before SERVING); ReadinessError on the first failure."""
        models = self._state.models
        if models is None:
            raise ReadinessError("no models loaded")

        def probe_all() -> None:
            for model in models.loaded():
                probe_model(model, models)
            if warm_up is not None:
                _warm_up(warm_up)

        engine.call(probe_all)

    def check_updated(self, role: str) -> None:
        """Probe `role` after its weights were swapped; call on the engine thread after the swap
        and before any experience job (Runtime does), so that none runs on weights not probed."""
        models = self._state.models
        model = None if models is None else getattr(models, role, None)
        if models is None or model is None:
            return
        try:
            probe_model(model, models)
        except ReadinessError as error:
            self._record(role, error)
        else:
            self._record(role, None)

    def _record(self, role: str, error: ReadinessError | None) -> None:
        with self._lock:
            was_failing = bool(self._failed_roles)
            if error is None:
                self._failed_roles.discard(role)
            else:
                self._failed_roles.add(role)
            now_failing = bool(self._failed_roles)
        if error is not None:
            _LOG.error("not serving: the %s weights failed the readiness probe: %s", role, error)
        if now_failing:
            # Also after another role's good update: runtime's swap may have said SERVING.
            self._state.set_phase(Phase.WAITING_FOR_WEIGHTS)
        elif was_failing:
            _LOG.info("serving again: the %s weights passed the readiness probe", role)
            if self._state.phase is Phase.WAITING_FOR_WEIGHTS:
                self._state.set_phase(Phase.SERVING)
