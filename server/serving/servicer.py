"""The rollserve.v1.Rollout servicer: a few lines of glue per RPC (KServe style).

Subscribe hands the call to the continuous rollout (continuous/subscribe.py).

Decoding, validation and the engine live elsewhere; this module maps state to messages and lets
`status.handles_errors` turn exceptions into statuses.
"""

from __future__ import annotations

import functools
import importlib.metadata
import threading
from collections.abc import Iterator
from typing import TypeVar

import grpc

from ...client.protocol.errors import FailedPrecondition, InvalidArgument, Unavailable
from ...client.protocol.roles import WIRE_ROLES as _ROLE
from ...client.protocol.shared_memory import shm_host_id
from ...client.protocol.wire import AtOnceMessages
from ...v1 import rollout_pb2 as pb
from ...v1 import rollout_pb2_grpc
from ..continuous import ContinuousRollout, RolloutStats, serve_subscribe
from ..engine.runtime import Runtime
from ..generation import GenerationSettings, built_engine, engine_path
from ..generation.compiling import eager_fallbacks
from ..state import Phase, ServerState
from ..weights import WeightUpdates
from ..weights.planes import offered_transports
from .idle_deadline import IdleDeadline
from .metrics import ServerMetrics
from .status import handles_errors

__all__ = [
    "RolloutServicer",
    "generation_facts",
    "health_response",
    "rollout_progress",
    "server_version",
]

T = TypeVar("T")

_STATUS = {
    Phase.LOADING: pb.SERVING_STATUS_LOADING,
    Phase.SERVING: pb.SERVING_STATUS_SERVING,
    Phase.WAITING_FOR_WEIGHTS: pb.SERVING_STATUS_WAITING_FOR_WEIGHTS,
    Phase.DRAINING: pb.SERVING_STATUS_DRAINING,
}


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Serves the RPCs of rollserve.v1.Rollout from a shared ServerState."""

    def __init__(
        self,
        state: ServerState,
        *,
        metrics: ServerMetrics | None = None,
        rollout: ContinuousRollout | None = None,
    ) -> None:
        self._state = state
        self._metrics = metrics or ServerMetrics(state)
        self._rollout = rollout  # None: the server was started without --rollout-prompts
        # Set once the models are loaded (serve_models); until then the bulk RPCs are UNAVAILABLE.
        self._runtime: Runtime | None = None
        self._updates: WeightUpdates | None = None

    def serve_models(self, runtime: Runtime, updates: WeightUpdates) -> None:
        """Start serving the bulk RPCs with the engine and updater of the loaded models."""
        self._runtime, self._updates = runtime, updates
        updates.phase_observer = self._metrics.observe_update_phases

    @handles_errors
    def MakeExperience(
        self, request: pb.MakeExperienceRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.MakeExperienceResponse]:
        cancelled = threading.Event()
        context.add_callback(cancelled.set)  # client gone or deadline: stop using the device
        responses = self._loaded(self._runtime).stream_experience(request, cancelled)
        yield from self._metrics.record_stream(responses)

    @handles_errors
    def UpdateWeights(
        self, request_iterator: Iterator[pb.UpdateWeightsRequest], context: grpc.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        # A stalled uploader must not hold the update lock and staging memory forever.
        idle_s = self._state.config.update_idle_timeout_s
        with IdleDeadline(context, idle_s, "UpdateWeights") as deadline:
            response = self._loaded(self._updates).update(deadline.wrap(request_iterator), context)
        self._metrics.observe_weight_update(response)
        return response

    @handles_errors
    def UpdateWeightsAtOnce(
        self, request: AtOnceMessages, context: grpc.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        # `request`: the stream's messages, parsed as read (handlers.py). Nothing to wait for,
        # so no idle deadline; an empty one is how a client asks whether this method exists.
        if not request:
            raise InvalidArgument(
                "an UpdateWeightsAtOnceRequest with no message (what a client sends to learn "
                "whether this server has the method)"
            )
        response = self._loaded(self._updates).update(iter(request), context)
        self._metrics.observe_weight_update(response)
        return response

    @handles_errors
    def InitWeightsGroup(
        self, request: pb.InitWeightsGroupRequest, context: grpc.ServicerContext
    ) -> pb.InitWeightsGroupResponse:
        planes = self._loaded(self._updates).planes
        if not planes.accepts("distributed"):
            raise FailedPrecondition("this server does not accept dist (--weight-transports)")
        # The rendezvous waits at most --max-group-timeout-s, and a caller that leaves frees
        # this handler thread at once (weights/distributed.py, _Join).
        return planes.groups.init(
            request,
            max_timeout_s=self._state.config.max_group_timeout_s,
            on_cancel=context.add_callback,
        )

    @handles_errors
    def DestroyWeightsGroup(
        self, request: pb.DestroyWeightsGroupRequest, context: grpc.ServicerContext
    ) -> pb.DestroyWeightsGroupResponse:
        self._loaded(self._updates).planes.groups.destroy(request.group)
        return pb.DestroyWeightsGroupResponse()

    @handles_errors
    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        return health_response(self._state, self._rollout)

    @handles_errors
    def Subscribe(
        self, request_iterator: Iterator[pb.SubscribeRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.SubscribeResponse]:
        for response in serve_subscribe(self._rollout, request_iterator, context):
            self._metrics.observe_experience(response.experience)
            yield response

    def _loaded(self, part: T | None) -> T:
        if part is None:
            raise Unavailable(f"the server is {self._state.phase.value}")
        return part


def health_response(
    state: ServerState, rollout: ContinuousRollout | None = None
) -> pb.HealthResponse:
    """Readiness, versions and model facts; reads state only, never the device."""
    response = pb.HealthResponse(
        status=_STATUS[state.phase],
        policy_version=state.policy_version("actor"),
        queue_depth=state.queue_depth(),
        uptime_s=state.uptime_s,
        server_version=server_version(),
        default_preset=state.default_preset,
    )
    if rollout is not None:
        response.rollout.CopyFrom(rollout_progress(rollout.stats()))
    models = state.models
    if models is None:  # still loading: nothing more is known yet
        return response
    response.device = models.device_label
    response.shm_host_id = SHM_HOST_ID
    # cuda_ipc only where the models are on CUDA (the server can open IPC handles there).
    response.weight_transports.extend(
        offered_transports(state.config.weight_transports, models.device)
    )
    response.vocab_size = models.vocab_size
    response.max_context_tokens = models.max_context_tokens
    response.generation_path, response.kv_cache_tokens = generation_facts(state)
    response.eager_fallbacks.extend(eager_fallbacks())
    for model in models.loaded():
        response.models.add(
            role=_ROLE[model.role],
            source=model.source,
            architecture=model.architecture,
            dtype=model.dtype,
            num_parameters=model.num_parameters,
            policy_version=state.policy_version(model.role),
        )
    return response


def generation_facts(state: ServerState) -> tuple[str, int]:
    """The actor's generation path and its engine's KV capacity in tokens (0 on the hf path
    and until the engine is built, which the start-up warm-up does before SERVING); pure:
    builds nothing, touches no device."""
    models = state.models
    if models is None:
        return "", 0
    actor = models.actor.module
    path = engine_path(actor, GenerationSettings.from_config(state.config))
    engine = built_engine(actor) if path == "rollserve" else None
    return path, 0 if engine is None else engine.capacity_tokens


# Who may use a SharedMemorySource (Health.shm_host_id): computed once, it never changes.
SHM_HOST_ID = shm_host_id()


def rollout_progress(stats: RolloutStats) -> pb.RolloutProgress:
    """Health.rollout of a server that runs a continuous rollout."""
    return pb.RolloutProgress(
        enabled=True,
        finished=stats.finished,
        epoch=stats.epoch,
        step=stats.step,
        batches_delivered=stats.delivered,
        batches_dropped_stale=stats.dropped_stale,
        queued_batches=stats.queued,
        subscribers=stats.subscribers,
    )


@functools.cache
def server_version() -> str:
    """The installed rollserve distribution's version ("unknown" when run from a bare tree)."""
    try:
        return importlib.metadata.version("rollserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
