"""The UpdateWeights state machine, the same for every data plane.

    header (read_header)
    -> plane (Planes.pick: a part of a parallel update? which source? accepted?)
    -> the update turn (one update streaming, one waiting, a third refused)
    -> target and version, checked before any bulk byte is received
    -> the target's staging arena, leased until the swap (staged tensors are its views)
    -> an UpdateStager fed by the plane -> finish (verify)
    -> the swap callable: `apply` on the engine thread, between two experience jobs (not when
       the call ended while it waited: `check_call`)
    -> the reply (and, for a parallel update, the same reply to every part)

Versions are held by ServerState (state.py): read here before receiving, and read again and
written by `apply` on the engine thread, so no experience job sees a half-written version.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import torch

from ...client.protocol.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from ...client.protocol.roles import ROLE_NAMES
from ...v1 import rollout_pb2 as pb
from ..capture_guard import apart_from_captures
from ..models import ModelSet
from ..state import ServerState
from .arena import staging_arena
from .header import DEFAULT_MAX_HEADER_BYTES
from .lora import LoraState
from .planes import DataPlane, Follower, Planes
from .staging import AppliedUpdate, Request, StagedUpdate, UpdateStager, read_header
from .timings import PhaseObserver, UpdateTimings

__all__ = ["IN_PLACE_MARGIN_S", "Call", "Swap", "WeightUpdates", "check_call"]

_LOG = logging.getLogger(__name__)

# swap(role, apply): run `apply` where no experience job can see it half done (the engine, between
# batches), plus whatever must follow a swap there; return what `apply` returned.
Swap = Callable[[str, Callable[[], AppliedUpdate]], AppliedUpdate]


class Call(Protocol):
    """What an update asks of its gRPC call (grpc.ServicerContext's methods)."""

    def is_active(self) -> bool: ...

    def time_remaining(self) -> float: ...


# An update staged in place (the trainer's CUDA IPC memory, read by apply itself) is applied
# only with at least this long left before the call's deadline: apply's reads (device copies:
# milliseconds) must end before the trainer may reuse that memory, which it may once the call
# has ended (rollout.proto), whether or not the reply reached it.
IN_PLACE_MARGIN_S = 0.5


def check_call(call: Call | None, in_place: bool) -> None:
    """Before apply (after the swap's wait, which lasts as long as the experience job then
    running): an update whose call has ended is not applied, Cancelled or DeadlineExceeded (the
    trainer was told it failed: its weights must not change behind its back); one staged in
    place, neither within IN_PLACE_MARGIN_S of its deadline. None: no call to ask (tests)."""
    if call is None:
        return
    if not call.is_active():
        raise Cancelled(
            "UpdateWeights: the call ended while the update waited for its swap; nothing was "
            "applied"
        )
    remaining = call.time_remaining()
    if in_place and remaining is not None and remaining < IN_PLACE_MARGIN_S:
        raise DeadlineExceeded(
            f"UpdateWeights: {remaining:.3f} s left of the call when its swap came, under the "
            f"{IN_PLACE_MARGIN_S} s an update staged in place (read from the trainer's memory "
            "by the swap itself) needs; nothing was applied"
        )


class WeightUpdates:
    """Receives, verifies and swaps in the weight updates of a set of target models."""

    def __init__(
        self,
        targets: Mapping[str, torch.nn.Module],
        state: ServerState,
        planes: Planes,
        swap: Swap,
        *,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    ) -> None:
        # targets: role -> module (the loaded models); state holds each role's version.
        self.planes = planes
        self._targets = dict(targets)
        self._state = state
        self._swap = swap
        self._max_header_bytes = max_header_bytes
        # The LoRA bases of each target (lora.py): what an adapter is merged onto.
        self.lora = {role: LoraState() for role in self._targets}
        self._update_lock = threading.Lock()  # one weight stream at a time
        # One stream updating, one more waiting; see _update_turn.
        self._update_slots = threading.BoundedSemaphore(2)
        # Told each finished update's phases (timings.py); the server's metrics observe them.
        self.phase_observer: PhaseObserver | None = None

    @classmethod
    def for_models(cls, models: ModelSet, state: ServerState, swap: Swap) -> WeightUpdates:
        """The updater of a server's loaded models, its planes from the server's flags."""
        targets = {model.role: model.module for model in models.loaded()}
        return cls(targets, state, Planes.from_config(state.config, models.device), swap)

    def update(
        self, requests: Iterator[Request], call: Call | None = None
    ) -> pb.UpdateWeightsResponse:
        """Stage and verify on this thread, then swap between batches; the reply. `call`: the
        gRPC call's context (check_call), None where there is none."""
        timings = UpdateTimings()
        header = read_header(requests)
        plane = self.planes.pick(header)
        if isinstance(plane, Follower):
            return plane.follow(requests)
        timings.lap("header")
        with self._update_turn(plane):
            timings.lap("turn")
            started_s = time.monotonic()
            with plane:
                role, staged_where, applied = self._stage_and_swap(
                    header, requests, plane, timings, call
                )
            seconds = time.monotonic() - started_s
            timings.lap("close")
        response = pb.UpdateWeightsResponse(
            target=header.target or pb.MODEL_ROLE_ACTOR,
            version=header.version,
            tensors=applied.tensors,
            bytes=applied.bytes,
            seconds=seconds,
            transport=plane.name,
        )
        plane.finished(response)
        timings.lap("reply")
        # One line per update, its phases included (bench_gpu_weights.py reads them).
        _LOG.info(
            "updated %s to version %d over %s: %d tensors, %d bytes in %.3f s (%.2f GB/s); "
            "staged %s; phases: %s",
            role,
            header.version,
            plane.name,
            applied.tensors,
            applied.bytes,
            seconds,
            applied.bytes / max(seconds, 1e-9) / 1e9,
            staged_where,
            timings.line(),
        )
        self._observe(timings)
        return response

    def _observe(self, timings: UpdateTimings) -> None:
        observer = self.phase_observer
        if observer is None:
            return
        try:
            observer(timings.phases)
        except Exception:  # metrics must never fail an update that was applied
            _LOG.exception("observing an update's phases failed")

    def close(self, wait_s: float = 0.0) -> bool:
        """Server stop: see Planes.close; whether nothing was left running."""
        return self.planes.close(wait_s)

    def _stage_and_swap(
        self,
        header: pb.WeightsHeader,
        requests: Iterator[Request],
        plane: DataPlane,
        timings: UpdateTimings,
        call: Call | None,
    ) -> tuple[str, str, AppliedUpdate]:
        """Check target and version, receive into the target's arena, verify, swap; the role,
        where it was staged (StagedUpdate.where), what apply did."""
        role, module = self._target(header)
        self._check_version(role, header.version)  # before receiving any bulk bytes
        stager: UpdateStager | None = None
        staged: StagedUpdate | None = None
        # Warm, reused staging memory; held until the swap: staged tensors are its views.
        with staging_arena(module).lease() as arena:
            try:
                stager = UpdateStager(
                    header,
                    module,
                    self.lora[role],
                    max_header_bytes=self._max_header_bytes,
                    arena=arena,
                    timings=timings,
                )
                # No CUDA graph capture meanwhile (capture_guard.py): receiving and verifying
                # synchronise with the device; the swap below does not hold it.
                with apart_from_captures(self.planes.device):  # the models' device
                    plane.receive(stager, requests)
                    timings.lap("receive")
                    staged = stager.finish()
                    timings.lap("finish")

                def apply() -> AppliedUpdate:  # on the engine thread, while this one waits
                    timings.lap("swap_wait")
                    assert staged is not None
                    # Not `staged` itself: the refusal's frame would keep its views (in place,
                    # the trainer's CUDA IPC memory) past the plane's exit.
                    check_call(call, staged.in_place)
                    applied = self._apply(role, module, staged)
                    timings.lap("apply")
                    return applied

                applied = self._swap(role, apply)
                timings.lap("swap_return")
                return role, staged.where, applied
            finally:
                # Nothing of this frame (kept by a traceback) or of `apply` (kept by the
                # engine's last job) may hold the staged views past the plane's exit: staged in
                # place, they are the plane's memory (a trainer's CUDA IPC buffer).
                if stager is not None:
                    stager.let_go()
                stager = staged = None

    @contextlib.contextmanager
    def _update_turn(self, plane: DataPlane) -> Iterator[None]:
        """The update lock; a third concurrent stream is refused rather than queued (and its
        `plane` told: it gives back what its header handed over).

        Every stream waiting for the lock holds a gRPC handler thread: stalled uploads would
        take all of them, and Health and MakeExperience would hang until each stall had timed
        out in turn (tests/test_cut_streams.py).
        """
        if not self._update_slots.acquire(blocking=False):
            plane.refused()
            raise ResourceExhausted(
                "UpdateWeights: one update is streaming and another is waiting for it; retry "
                "once they finish"
            )
        try:
            with self._update_lock:
                yield
        finally:
            self._update_slots.release()

    def _target(self, header: pb.WeightsHeader) -> tuple[str, torch.nn.Module]:
        role = ROLE_NAMES.get(header.target)
        if role is None:
            raise InvalidArgument(f"header.target: unknown model role {header.target}")
        module = self._targets.get(role)
        if module is None:
            raise FailedPrecondition(f"header.target: this server has no {role} model loaded")
        return role, module

    def _check_version(self, role: str, version: int) -> None:
        current = self._state.policy_version(role)
        if version <= current:
            raise FailedPrecondition(
                f"header.version: {version} is not above the {role}'s current version {current}"
            )

    def _apply(self, role: str, module: torch.nn.Module, staged: StagedUpdate) -> AppliedUpdate:
        """Run by the swap, where no experience job is running: atomic for them."""
        self._check_version(role, staged.version)
        applied = staged.apply(module)
        self._state.set_policy_version(role, staged.version)
        return applied
