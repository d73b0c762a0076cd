"""What a serving server runs on its engine thread: experience jobs and weight swaps.

MakeExperience is decoded here (before anything is queued) and made on the engine; a verified
weight update (weights/update.py) hands its `apply` to `swap`, which runs it on the engine
between two experience jobs, so every sample is made by one version. The servicer only decodes
and encodes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from ...client.protocol.errors import FailedPrecondition, Unavailable
from ...client.protocol.experience import experience_to_proto
from ...v1 import rollout_pb2 as pb
from ..experience.maker import NaiveExperienceMaker
from ..state import Phase, ServerState
from .worker import Engine

__all__ = ["Runtime"]

T = TypeVar("T")


class Runtime:
    """The engine thread plus the jobs the Rollout RPCs run on it."""

    def __init__(
        self,
        state: ServerState,
        maker: NaiveExperienceMaker,
        *,
        after_update: Callable[[str], None] | None = None,
    ) -> None:
        # after_update(role): runs on the engine after a swap, before any job that is not a swap
        # (the readiness probe of the new weights); the update's reply does not wait for it.
        self._after_update = after_update
        self.state = state
        self.maker = maker
        self.engine = Engine(max_queue_depth=state.config.max_queue_depth)
        state.watch_queue(lambda: self.engine.queue_depth)
        device = maker.models.device
        if device.type == "cuda" and device.index is not None:
            # The engine thread's current device is the models' (a thread starts on cuda:0):
            # what CUDA calls without a device (a stream, an event, a synchronize) use there.
            self.engine.call(lambda: torch.cuda.set_device(device))

    def stream_experience(
        self, request: pb.MakeExperienceRequest, cancelled: threading.Event
    ) -> Iterator[pb.MakeExperienceResponse]:
        """Validate here, make on the engine thread, encode here as micro-batches arrive."""
        self._check_accepting()
        spec = self.maker.decode(request)

        def produce():
            # Again on the engine: a probe that ran since the check above may have failed.
            self._check_accepting()
            version = self.state.policy_version("actor")  # read on the engine: no swap races it
            yield from self.maker.iter_experience(spec, policy_version=version, cancelled=cancelled)

        for index, experience in enumerate(self.engine.stream(produce, cancelled=cancelled)):
            yield pb.MakeExperienceResponse(
                experience=experience_to_proto(experience),
                micro_batch_index=index,
                num_micro_batches=spec.num_micro_batches,
                pad_token_id=self.maker.pad_token_id,
            )

    def swap(self, role: str, apply: Callable[[], T]) -> T:
        """Run a verified update's `apply` on the engine thread, between two experience jobs;
        then the probe of the new weights (after_update), before any job that is not a swap
        (Engine.call_then keyed by role: a newer update of the role replaces a probe not yet
        run, and an idle engine runs it after FOLLOW_UP_IDLE_S)."""

        def job() -> T:
            applied = apply()
            if role == "actor" and self.state.phase is Phase.WAITING_FOR_WEIGHTS:
                self.state.set_phase(Phase.SERVING)
            return applied

        after_update = self._after_update
        if after_update is None:
            return self.engine.call(job)
        return self.engine.call_then(job, lambda _: after_update(role), key=role)

    def close(self, timeout_s: float = 30.0) -> None:
        # Wait for the worker: a process that exits while it is inside a torch op (e.g. the
        # readiness probe queued after an update) dies with std::terminate (SIGABRT).
        self.engine.close(wait=True, timeout_s=timeout_s)

    def _check_accepting(self) -> None:
        phase = self.state.phase
        if phase is Phase.WAITING_FOR_WEIGHTS:
            raise FailedPrecondition(
                "the server is waiting for its first weights (--wait-for-weights) or for weights "
                "that pass its readiness check; call UpdateWeights"
            )
        # DRAINING still serves: during the drain delay load balancers move away, and after it
        # grpc itself refuses new calls while in-flight ones finish.
        if phase not in (Phase.SERVING, Phase.DRAINING):
            raise Unavailable(f"the server is {phase.value}")
