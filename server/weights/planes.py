"""The data planes of UpdateWeights: how the file's bytes reach the UpdateStager.

Each plane is a context manager around one update (entered before the target and version checks,
so that it can clean up after any refusal) with `receive(stager, requests)`, which brings every
byte of the file into the stager's lanes, and `finished(response)`, called with the reply after
the swap. `Planes.pick` is the one place that reads a header's choice of plane: a part of a
parallel update (the leader, or a `Follower` of it), which `source`, and whether this server
accepts it (--weight-transports). update.py runs the state machine around the plane (checks,
arena lease, finish, swap) the same way for all of them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import torch

from ...client.protocol.errors import FailedPrecondition, InvalidArgument
from ...client.protocol.shared_memory import shm_host_id
from ...client.protocol.transports import (
    CUDA_IPC,
    DIST,
    GRPC,
    GRPC_PARALLEL,
    SHM,
    SOURCE_TRANSPORTS,
)
from ...v1 import rollout_pb2 as pb
from ..config import ServerConfig
from .cuda_ipc import CudaIpcPlane, KeptIpcBuffers, can_open_cuda_ipc, keeps_buffers
from .distributed import GroupUpdate, WeightsGroups
from .parallel import Assembly, ParallelUpdates, check_part, feed_part
from .shared_memory import default_lanes, receive_shared_memory, release_mappings
from .staging import Request, UpdateStager, iter_chunks
from .timings import waited

__all__ = ["DataPlane", "Follower", "Planes", "offered_transports"]


def offered_transports(transports: str, device: torch.device) -> list[str]:
    """The transports a server offers (Health.weight_transports): --weight-transports (normalised,
    "grpc,shm,dist,cuda_ipc"), less cuda_ipc unless the models are on a CUDA device."""
    return [name for name in transports.split(",") if name != CUDA_IPC or can_open_cuda_ipc(device)]


class DataPlane(Protocol):
    name: str  # the transport in replies, metrics and logs

    def __enter__(self) -> DataPlane: ...

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def receive(self, stager: UpdateStager, requests: Iterator[Request]) -> None: ...

    def finished(self, response: pb.UpdateWeightsResponse) -> None: ...

    def refused(self) -> None:
        """The update was refused before the plane was entered (its turn: a third update at
        once): give back what the header handed this server (cuda_ipc: the trainer's ref
        counters), as __exit__ would have."""
        ...


class _Plane:
    """Nothing to set up or clean up."""

    name = ""

    def __enter__(self) -> _Plane:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def finished(self, response: pb.UpdateWeightsResponse) -> None:
        return None

    def refused(self) -> None:
        # dist: a rank refused without its turn casts no vote (a collective outside the
        # update lock could meet another update's); the group's ranks fail at their timeout.
        return None


class _Chunks(_Plane):
    """Chunks on this stream, in order (the universal path)."""

    name = GRPC

    def receive(self, stager: UpdateStager, requests: Iterator[Request]) -> None:
        for offset, data, crc32 in iter_chunks(waited(requests, stager.timings, "stream_wait")):
            stager.feed(offset, data, crc32)


class _SharedMemory(_Plane):
    """A sealed memfd of a client on this host, copied by `lanes` threads (while the client
    still writes it, when streamed); no chunks."""

    name = SHM

    def __init__(self, source: pb.SharedMemorySource, lanes: int) -> None:
        self._source = source
        self._lanes = lanes

    def receive(self, stager: UpdateStager, requests: Iterator[Request]) -> None:
        receive_shared_memory(stager, self._source, requests, lanes=self._lanes)


class _Broadcast(_Plane):
    """The head on this stream, the data by a torch.distributed broadcast (GroupUpdate)."""

    name = DIST

    def __init__(self, groups: WeightsGroups, source: pb.DistributedSource) -> None:
        self._update = GroupUpdate(groups, source)

    def __enter__(self) -> _Broadcast:
        self._update.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        # A refusal before the vote still casts it: the other ranks wait for it.
        self._update.__exit__(*exc_info)

    def receive(self, stager: UpdateStager, requests: Iterator[Request]) -> None:
        self._update.receive(stager, requests)


class _ParallelLead(_Plane):
    """Part 0 of a parallel update: its own range, then every other part (parallel.py)."""

    name = GRPC_PARALLEL

    def __init__(self, updates: ParallelUpdates, header: pb.WeightsHeader) -> None:
        self._updates = updates
        self._header = header
        self._assembly: Assembly | None = None

    def receive(self, stager: UpdateStager, requests: Iterator[Request]) -> None:
        self._assembly = assembly = self._updates.open(self._header, stager)
        part = waited(requests, stager.timings, "stream_wait")  # part 0's only
        feed_part(stager.lane(0, self._header.parallel.end), part)
        assembly.part_done()
        assembly.wait_parts(self._updates.wait_s)

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        if self._assembly is None:
            return
        if error is not None:
            self._assembly.fail(error, 0)  # the other parts return this status too
        self._updates.close(self._header, error)

    def finished(self, response: pb.UpdateWeightsResponse) -> None:
        if self._assembly is not None:
            self._assembly.succeed(response)  # the other parts return this reply too


@dataclass(frozen=True)
class Follower:
    """Part 1..N-1 of a parallel update: no plane of its own, it feeds the leader's stager."""

    parallel: ParallelUpdates
    header: pb.WeightsHeader

    def follow(self, requests: Iterator[Request]) -> pb.UpdateWeightsResponse:
        """Write this stream's range into the leader's stager; the leader's reply."""
        return self.parallel.follow(self.header, requests)


class Planes:
    """The data planes this server offers, what they share across updates (copy lanes, weights
    groups, parallel assemblies), and the one place that picks a plane for a header."""

    def __init__(
        self, transports: str, device: torch.device, *, parallel_wait_s: float = 30.0
    ) -> None:
        # transports: --weight-transports, normalised ("grpc,shm,dist"); device: the models'.
        offered = offered_transports(transports, device)
        self.device = device
        self.host_id = shm_host_id()  # who may hand this server CUDA IPC handles
        self.sources = frozenset(s for s, name in SOURCE_TRANSPORTS.items() if name in offered)
        self.shm_lanes = default_lanes(os.cpu_count())  # threads copying from shared memory
        self.groups = WeightsGroups(device)
        self.parallel = ParallelUpdates(wait_s=parallel_wait_s)
        # CUDA IPC buffers kept open from one update to the next (cuda_ipc.py, "Kept open").
        self.kept_ipc = KeptIpcBuffers() if keeps_buffers() else None

    @classmethod
    def from_config(cls, config: ServerConfig, device: torch.device) -> Planes:
        return cls(config.weight_transports, device, parallel_wait_s=config.parallel_part_wait_s)

    def accepts(self, source: str) -> bool:
        """Whether this server takes updates whose header names `source` (a oneof field)."""
        return source in self.sources

    def pick(self, header: pb.WeightsHeader) -> DataPlane | Follower:
        """The plane the header asks for: parallel or not, which source, and accepted or not."""
        parallel = header.HasField("parallel")
        if parallel:
            check_part(header)
            if header.parallel.index > 0:
                return Follower(self.parallel, header)
        source = header.WhichOneof("source")
        if source == "cuda_ipc" and not parallel:
            # Its shape, the host and the device first (each a clear refusal), then the flag.
            plane = CudaIpcPlane(
                header, device=self.device, host_id=self.host_id, kept=self.kept_ipc
            )
            if not self.accepts(source):
                plane.refused()
                raise FailedPrecondition(
                    "cuda_ipc: this server does not accept that transport (--weight-transports)"
                )
            return plane
        if source is not None and not self.accepts(source):
            raise FailedPrecondition(f"header.{source}: this server does not accept that transport")
        if parallel:
            if source is not None:
                raise InvalidArgument("header.parallel: parallel streams carry chunks, no source")
            return _ParallelLead(self.parallel, header)
        if source == "shared_memory":
            return _SharedMemory(header.shared_memory, self.shm_lanes)
        if source == "distributed":
            return _Broadcast(self.groups, header.distributed)
        return _Chunks()

    def close(self, wait_s: float = 0.0) -> bool:
        """Leave every weights group, unmap cached shared-memory files and close kept CUDA IPC
        buffers (server stop); whether every rendezvous thread ended within wait_s
        (WeightsGroups.close)."""
        ended = self.groups.close(wait_s)
        release_mappings()
        if self.kept_ipc is not None:
            self.kept_ipc.release()
        return ended
