"""The data planes of UpdateWeights: how the file's bytes reach the UpdateStager.

Each plane is a context manager around one update (entered before the target and version checks,
so that it can clean up after any refusal) with `receive(stager, requests)`, which brings every
byte of the file into the stager's lanes, and `finished(response)`, called with the reply after
the swap. `data_plane(header, ...)` picks the plane from the header; runtime.py runs the state
machine around it (checks, arena lease, finish, swap) the same way for all of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType
from typing import Protocol

from ...client.protocol.errors import InvalidArgument
from ...v1 import rollout_pb2 as pb
from .distributed import GroupUpdate, WeightsGroups
from .parallel import Assembly, ParallelUpdates, feed_part
from .shared_memory import receive_shared_memory
from .staging import Request, UpdateStager, iter_chunks

__all__ = ["DataPlane", "data_plane"]


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


class _Plane:
    """Nothing to set up or clean up."""

    name = ""

    def __enter__(self) -> _Plane:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def finished(self, response: pb.UpdateWeightsResponse) -> None:
        return None


class _Chunks(_Plane):
    """Chunks on this stream, in order (the universal path)."""

    name = "grpc"

    def receive(self, stager: UpdateStager, requests: Iterator[Request]) -> None:
        for offset, data, crc32 in iter_chunks(requests):
            stager.feed(offset, data, crc32)


class _SharedMemory(_Plane):
    """A sealed memfd of a client on this host, copied by `lanes` threads (while the client
    still writes it, when streamed); no chunks."""

    name = "shm"

    def __init__(self, source: pb.SharedMemorySource, lanes: int) -> None:
        self._source = source
        self._lanes = lanes

    def receive(self, stager: UpdateStager, requests: Iterator[Request]) -> None:
        receive_shared_memory(stager, self._source, requests, lanes=self._lanes)


class _Broadcast(_Plane):
    """The head on this stream, the data by a torch.distributed broadcast (GroupUpdate)."""

    name = "dist"

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

    name = "grpc-parallel"

    def __init__(self, updates: ParallelUpdates, header: pb.WeightsHeader) -> None:
        if header.WhichOneof("source") is not None:
            raise InvalidArgument("header.parallel: parallel streams carry chunks, no source")
        self._updates = updates
        self._header = header
        self._assembly: Assembly | None = None

    def receive(self, stager: UpdateStager, requests: Iterator[Request]) -> None:
        self._assembly = assembly = self._updates.open(self._header, stager)
        feed_part(stager.lane(0, self._header.parallel.end), requests)
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


def data_plane(
    header: pb.WeightsHeader,
    *,
    shm_lanes: int,
    groups: WeightsGroups,
    parallel: ParallelUpdates,
) -> DataPlane:
    """The plane the header asks for (a parallel part > 0 never gets here: see runtime.py)."""
    if header.HasField("parallel"):
        return _ParallelLead(parallel, header)
    source = header.WhichOneof("source")
    if source == "shared_memory":
        return _SharedMemory(header.shared_memory, shm_lanes)
    if source == "distributed":
        return _Broadcast(groups, header.distributed)
    return _Chunks()
