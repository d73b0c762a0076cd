"""What a serving server runs once its models are loaded: the engine, the experience maker and
the weight updater, behind the two bulk RPCs. The servicer only decodes and encodes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

from ...client.protocol.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from ...client.protocol.experience import experience_to_proto
from ...client.protocol.roles import ROLE_NAMES as _ROLES
from ...client.protocol.transports import SOURCE_TRANSPORTS as _SOURCES
from ...v1 import rollout_pb2 as pb
from ..experience.maker import NaiveExperienceMaker
from ..models import LoadedModel, ModelSet, Phase, ServerState
from ..weights import (
    AppliedUpdate,
    LoraState,
    StagedUpdate,
    UpdateStager,
    read_header,
    staging_arena,
)
from ..weights.distributed import WeightsGroups
from ..weights.parallel import ParallelUpdates, check_part, feed_part
from ..weights.planes import DataPlane, data_plane
from ..weights.shared_memory import default_lanes, release_mappings
from ..weights.staging import Request
from .worker import Engine

__all__ = ["Runtime"]

_LOG = logging.getLogger(__name__)
_FOLLOWER_RESULT_WAIT_S = 3600.0


class Runtime:
    """The engine thread plus the operations the Rollout RPCs run on it."""

    def __init__(
        self,
        state: ServerState,
        models: ModelSet,
        maker: NaiveExperienceMaker,
        *,
        after_update: Callable[[str], None] | None = None,
    ) -> None:
        # after_update(role): runs on the engine right after a swap, before any other job (the
        # readiness probe of the new weights); the update's reply does not wait for it.
        self._after_update = after_update
        self.state = state
        self.models = models
        self.maker = maker
        self.engine = Engine(max_queue_depth=state.config.max_queue_depth)
        self._update_lock = threading.Lock()  # one weight stream at a time
        # One stream updating, one more waiting; see _update_turn.
        self._update_slots = threading.BoundedSemaphore(2)
        self._lora = {model.role: LoraState() for model in models.loaded()}
        # Data planes beside chunks on the stream (server/weights/): the header's `source`.
        enabled = state.config.weight_transports.split(",")
        self.weight_sources = frozenset(
            source for source, name in _SOURCES.items() if name in enabled
        )
        self.shm_lanes = default_lanes(os.cpu_count())  # threads copying from shared memory
        self.weight_groups = WeightsGroups(models.device)
        self.parallel_updates = ParallelUpdates(wait_s=state.config.parallel_part_wait_s)

    # ---- MakeExperience ----------------------------------------------------------------------

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
            if spec.min_policy_version > version:
                raise FailedPrecondition(
                    f"min_policy_version: {spec.min_policy_version} requested, the actor is at "
                    f"version {version}"
                )
            yield from self.maker.iter_experience(spec, policy_version=version, cancelled=cancelled)

        for index, experience in enumerate(self.engine.stream(produce, cancelled=cancelled)):
            yield pb.MakeExperienceResponse(
                experience=experience_to_proto(experience),
                micro_batch_index=index,
                num_micro_batches=spec.num_micro_batches,
                pad_token_id=self.maker.pad_token_id,
            )

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

    # ---- UpdateWeights -----------------------------------------------------------------------
    #
    # One state machine for every data plane: read the header, check target and version, lease
    # the target's staging arena, receive the file's bytes into one UpdateStager (the data plane
    # only decides how they arrive: chunks on this stream, a shared-memory file, a broadcast,
    # or several streams), finish (verify), swap on the engine thread.

    def update_weights(
        self, requests: Iterator[pb.UpdateWeightsRequest]
    ) -> pb.UpdateWeightsResponse:
        """Stage and verify on this thread, then swap on the engine thread between batches."""
        header = read_header(requests)
        if header.HasField("parallel"):
            check_part(header)
            if header.parallel.index > 0:
                return self._join_parallel(header, requests)
        source = header.WhichOneof("source")
        if source is not None and source not in self.weight_sources:
            raise FailedPrecondition(f"header.{source}: this server does not accept that transport")
        with self._update_turn():
            started_s = time.monotonic()
            plane = data_plane(
                header,
                shm_lanes=self.shm_lanes,
                groups=self.weight_groups,
                parallel=self.parallel_updates,
            )
            with plane:
                role, staged, applied = self._stage_and_swap(header, requests, plane)
            seconds = time.monotonic() - started_s
        response = pb.UpdateWeightsResponse(
            target=header.target or pb.MODEL_ROLE_ACTOR,
            version=header.version,
            tensors=applied.tensors,
            bytes=staged.total_bytes,
            seconds=seconds,
            transport=plane.name,
        )
        plane.finished(response)
        _LOG.info(
            "updated %s to version %d over %s: %d tensors, %d bytes in %.2f s (%.2f GB/s)",
            role,
            header.version,
            plane.name,
            applied.tensors,
            staged.total_bytes,
            seconds,
            staged.total_bytes / max(seconds, 1e-9) / 1e9,
        )
        return response

    def _stage_and_swap(
        self, header: pb.WeightsHeader, requests: Iterator[Request], plane: DataPlane
    ) -> tuple[str, StagedUpdate, AppliedUpdate]:
        """Check target and version, receive into the target's arena, verify, swap."""
        role, model = self._target(header)
        self._check_version(role, header.version)  # before receiving any bulk bytes
        # Warm, reused staging memory; held until the swap: staged tensors are its views.
        with staging_arena(model.module).lease() as arena:
            stager = UpdateStager(header, model.module, self._lora[role], arena=arena)
            plane.receive(stager, requests)
            staged = stager.finish()
            return role, staged, self._run_swap(role, model, staged)

    def _join_parallel(
        self, header: pb.WeightsHeader, requests: Iterator[Request]
    ) -> pb.UpdateWeightsResponse:
        """Parts 1..N-1: write this stream's range into the leader's stager; the same reply."""
        index = header.parallel.index
        assembly = self.parallel_updates.join(header)
        try:
            lane = assembly.join(header)
            lane.start_in_data(self.parallel_updates.wait_s)
            feed_part(lane, requests)
            assembly.part_done()
        except BaseException as error:
            assembly.fail(error, index)
            raise
        # The leader resolves the assembly on every path (its reply or its error); the bound only
        # keeps a handler thread from waiting forever on a bug.
        return assembly.wait_result(_FOLLOWER_RESULT_WAIT_S)

    @contextlib.contextmanager
    def _update_turn(self) -> Iterator[None]:
        """The update lock; a third concurrent stream is refused rather than queued.

        Every stream waiting for the lock holds a gRPC handler thread: 16 stalled uploads took
        all of them, and Health and MakeExperience hung until each stall had timed out in turn
        (issue 12, tests/test_cut_streams.py).
        """
        if not self._update_slots.acquire(blocking=False):
            raise ResourceExhausted(
                "UpdateWeights: one update is streaming and another is waiting for it; retry "
                "once they finish"
            )
        try:
            with self._update_lock:
                yield
        finally:
            self._update_slots.release()

    def _target(self, header: pb.WeightsHeader) -> tuple[str, LoadedModel]:
        role = _ROLES.get(header.target)
        if role is None:
            raise InvalidArgument(f"header.target: unknown model role {header.target}")
        model = getattr(self.models, role)
        if model is None:
            raise FailedPrecondition(f"header.target: this server has no {role} model loaded")
        return role, model

    def _check_version(self, role: str, version: int) -> None:
        current = self.state.policy_version(role)
        if version <= current:
            raise FailedPrecondition(
                f"header.version: {version} is not above the {role}'s current version {current}"
            )

    def _run_swap(self, role: str, model: LoadedModel, staged: StagedUpdate) -> AppliedUpdate:
        def swap() -> AppliedUpdate:
            return self._swap(role, model, staged)

        after_update = self._after_update
        if after_update is None:
            return self.engine.call(swap)
        return self.engine.call_then(swap, lambda _: after_update(role))

    def _swap(self, role: str, model: LoadedModel, staged: StagedUpdate) -> AppliedUpdate:
        """On the engine thread: no experience job is running, so the swap is atomic for them."""
        self._check_version(role, staged.version)
        applied = staged.apply(model.module)
        self.state.set_policy_version(role, staged.version)
        if role == "actor":
            self.maker.policy_version = staged.version  # the in-process API stamps the same
        if role == "actor" and self.state.phase is Phase.WAITING_FOR_WEIGHTS:
            self.state.set_phase(Phase.SERVING)
        return applied

    def close(self, timeout_s: float = 30.0) -> None:
        # Wait for the worker: a process that exits while it is inside a torch op (e.g. the
        # readiness probe queued after an update) dies with std::terminate (SIGABRT).
        self.engine.close(wait=True, timeout_s=timeout_s)
        self.weight_groups.close()
        release_mappings()
