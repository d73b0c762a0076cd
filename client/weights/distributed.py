"""WeightsGroup: one torch.distributed broadcast updates every rollout server of the group.

    group = WeightsGroup([client_a, client_b], master_address="10.0.0.5")  # this host's address
    group.flatten_weights(policy)  # optional, once: one buffer, broadcast in plain 32 MiB slices
    group.update_weights(policy.state_dict(), version=step)                 # one broadcast
    group.close()

The trainer is rank 0 and hosts the rendezvous (a TCPStore on master_address:master_port; port 0
picks a free one); every server joins through InitWeightsGroup (the admin token is needed). An
update sends each server the header and the file's head (one UpdateWeightsAtOnce call), then all
ranks vote (an all-reduce MAX: a server that refuses, e.g. a stale version, votes 1 and nobody
broadcasts), then rank 0 broadcasts the data section in ranges of at most bucket_bytes, taking
the group's `lanes` (process groups over the one rendezvous, each its own connections) in turn
so that several broadcasts move at once (gloo runs one per connection). Each server
verifies what it received and swaps exactly as for any other transport; each reply comes back
over gRPC. Backends: gloo (CPU tensors; any server) and nccl (CUDA tensors; servers on a GPU).

A failed broadcast (a rank died, a timeout) leaves the collectives out of step: the group is
then broken, every member drops it, and the trainer makes a new one.

Forming a group first waits (up to timeout_s) for every server to finish loading, so a trainer
may form one against a server it has just started. A group that cannot be formed (a server
refuses, a join fails) fails at once and frees what it held: the store's port closes, so no
rank, this process's included, waits out the store's timeout.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import datetime
import functools
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np
import torch
import torch.distributed as dist

from ...v1 import rollout_pb2 as pb
from ..protocol.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    from_rpc_error,
    typed_errors,
)
from ..protocol.process_group import (
    BACKENDS,
    CONTIGUOUS_BUCKET_BYTES,
    DEFAULT_BUCKET_BYTES,
    MAX_LANES,
    BucketBuffers,
    broadcast_spans,
    default_lanes,
    new_process_groups,
    shut_down,
)
from ..protocol.requests import DEFAULT_CHUNK_BYTES, Progress, UpdateOptions
from ..protocol.results import UpdateResult
from ..protocol.transports import AUTO, DIST
from .flat_weights import data_section_run, flatten_weights
from .server_calls import ServerCalls
from .update_file import UpdateFile, WeightSpec, prepare_update

__all__ = ["DEFAULT_BUCKET_BYTES", "GroupMember", "WeightsGroup", "group_of"]

_READY = 0
# Broadcasts in flight per lane while the next is filled (the servers post as many receives).
_IN_FLIGHT_PER_LANE = 2
_VOTE_GRACE_S = 5.0  # how long a failed call's vote may still arrive
_REPLY_POLL_S = 0.05
_LOST_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS,
})  # fmt: skip
_FOLLOWED_VOTE = "another rank of the group refused"
_HEALTH_CALL_S = 5.0  # one Health call while waiting for a server that is loading
_LOADING_POLL_S = 0.2
_OWN_JOIN_END_S = 5.0  # how long a failed formation waits for its own join to end


class GroupMember(Protocol):
    """What a WeightsGroup needs of a client (RolloutClient and AsyncRolloutClient are members):
    its server's target and weights-side calls."""

    target: str

    @property
    def weights_calls(self) -> ServerCalls: ...


class WeightsGroup:
    """This trainer (rank 0) and the servers of `clients` (ranks 1..N) in one process group.

    timeout_s: how long to wait for a server that is still loading, then for the rendezvous, and
    the collectives' timeout. bucket_bytes: bytes per broadcast at most (default 8 MiB for
    ranges that follow the tensors, 32 MiB for flattened weights); lanes: process groups the
    broadcasts take in turn (default 2 for gloo, 1 for NCCL; up to MAX_LANES).
    """

    def __init__(
        self,
        clients: Sequence[GroupMember],
        *,
        name: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        bucket_bytes: int | None = None,
        lanes: int | None = None,
    ) -> None:
        if not clients:
            raise InvalidArgument("clients: a group needs at least one server")
        if backend not in BACKENDS:
            raise InvalidArgument(f"backend: one of {', '.join(BACKENDS)}, got {backend!r}")
        if bucket_bytes is not None and not 0 < bucket_bytes <= 1024 * 1024 * 1024:
            raise InvalidArgument(f"bucket_bytes: 1 to 1 GiB, got {bucket_bytes}")
        lanes = default_lanes(backend) if lanes is None else lanes
        if not 1 <= lanes <= MAX_LANES:
            raise InvalidArgument(f"lanes: 1 to {MAX_LANES}, got {lanes}")
        self.name = name or f"rollserve-{uuid.uuid4().hex[:12]}"
        self.clients = tuple(clients)
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.lanes = lanes
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        self._timeout_s = timeout_s
        self._broken = False
        self._lock = threading.Lock()  # one update at a time: collectives must stay in order
        self._wait_until_loaded(time.monotonic() + timeout_s)
        self._store: dist.TCPStore | None = None
        self._store, self._process_groups = self._form(master_address, master_port)

    def _wait_until_loaded(self, deadline: float) -> None:
        """Until every server has loaded its models (Health says anything but LOADING): a server
        that was just started answers InitWeightsGroup UNAVAILABLE until then. Unavailable at
        the deadline, or at once for a server that is draining; Health's own errors (a bad
        token, say) at once."""
        for client in self.clients:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Unavailable(
                        f"{client.target} did not finish loading within {self._timeout_s:g} s "
                        "(timeout_s); no group was formed"
                    )
                try:
                    with typed_errors():
                        status = client.weights_calls.health(
                            min(remaining, _HEALTH_CALL_S), wait_for_ready=True
                        ).status
                except (Unavailable, DeadlineExceeded):
                    status = pb.SERVING_STATUS_LOADING  # not listening yet: wait on
                if status == pb.SERVING_STATUS_DRAINING:
                    raise Unavailable(f"{client.target} is draining; no group was formed")
                if status != pb.SERVING_STATUS_LOADING:
                    break
                time.sleep(min(_LOADING_POLL_S, max(deadline - time.monotonic(), 0.0)))

    def _form(
        self, master_address: str, master_port: int
    ) -> tuple[dist.TCPStore, tuple[dist.ProcessGroup, ...]]:
        """The rendezvous: this process hosts the store and joins as rank 0 while every server
        joins through InitWeightsGroup (every rank blocks until all joined); the store (kept
        for the group's life) and the lanes.

        A failure anywhere (a server refuses, a join times out) fails the group at once and
        frees what it holds: the other servers' calls are cancelled, and dropping the store
        (this frame holds its only reference) closes its port and every connection to it, so
        this process's own join and any server's join still waiting in the store fail at
        once instead of at the store's timeout.
        """
        store = dist.TCPStore(
            master_address,
            master_port,
            len(self.clients) + 1,
            is_master=True,
            timeout=datetime.timedelta(seconds=self._timeout_s),
            wait_for_workers=False,
        )
        own = _OwnJoin(self._join_kwargs(master_address, store.port))
        joins = [
            client.weights_calls.start_init_weights_group(
                self._join_request(master_address, store.port, rank), self._timeout_s + 10.0
            )
            for rank, client in enumerate(self.clients, start=1)
        ]
        try:
            return store, _await_rendezvous(own, joins)
        except BaseException:
            for join in joins:
                join.cancel()
            del store  # the master's port and connections close: the joins fail at once
            own.finish(_OWN_JOIN_END_S)
            raise

    def _join_request(
        self, master_address: str, master_port: int, rank: int
    ) -> pb.InitWeightsGroupRequest:
        return pb.InitWeightsGroupRequest(
            group=self.name,
            master_address=master_address,
            master_port=master_port,
            world_size=len(self.clients) + 1,
            rank=rank,
            backend=self.backend,
            timeout_s=self._timeout_s,
            lanes=self.lanes,
        )

    def _join_kwargs(self, master_address: str, master_port: int) -> dict[str, Any]:
        # No store=: rank 0 joins over its own connection to the master, like the servers, so
        # that closing the master ends this join too.
        return dict(
            group=self.name,
            master_address=master_address,
            master_port=master_port,
            world_size=len(self.clients) + 1,
            rank=0,
            backend=self.backend,
            timeout_s=self._timeout_s,
            lanes=self.lanes,
        )

    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | torch.nn.Module,
        *,
        version: int,
        progress: Progress | None = None,
        options: UpdateOptions | None = None,
        **fields: Any,
    ) -> list[UpdateResult]:
        """One broadcast to every server; their results in the order of `clients`.

        `options` and/or the fields of UpdateOptions as keywords, as for
        RolloutClient.update_weights (target, mode, lora, sha256, allow_non_finite, manifest,
        timeout_s, request_id; the broadcast has no chunks, so no crc32). Raises the first
        server's error if any refused or failed.
        """
        options = UpdateOptions.of(options, **fields)
        update = prepare_update(
            weights,
            version=version,
            options=dataclasses.replace(options, chunk_bytes=DEFAULT_CHUNK_BYTES, crc32=False),
        )
        with self._lock:
            if self._broken:
                raise FailedPrecondition(f"weights group {self.name!r} is broken; make a new one")
            started_s = time.monotonic()
            plan = _BroadcastPlan.of(update, self.device, self.bucket_bytes)
            calls = self._start_calls(update, plan, options.timeout_s, options.request_id)
            failure = self._vote_and_broadcast(calls, plan, progress)
            if failure is not None:
                # Outside the except block: its traceback no longer holds the broadcast's
                # frames, so _break can drop the last references to the lanes.
                for call in calls:
                    call.cancel()
                self._break()
                raise Unavailable(f"weights group {self.name!r}: {failure}")
            replies = self._replies(calls)
        wall_s = time.monotonic() - started_s
        return [UpdateResult.from_proto(reply, wall_s=wall_s) for reply in replies]

    def index(self, member: GroupMember) -> int:
        """Where `member` stands in `clients` (and its result in update_weights')."""
        if member not in self.clients:
            raise InvalidArgument(f"group {self.name!r} does not hold this client's server")
        return self.clients.index(member)

    def _vote_and_broadcast(
        self,
        calls: list[grpc.Future],
        plan: _BroadcastPlan,
        progress: Progress | None,
    ) -> str | None:
        """The vote, then the broadcast if every rank is ready; why they failed, else None."""
        try:
            if self._vote(calls):
                self._broadcast(plan, progress)
        except Exception as error:
            return str(error)
        return None

    def _start_calls(
        self,
        update: UpdateFile,
        plan: _BroadcastPlan,
        timeout_s: float | None,
        request_id: str | None,
    ) -> list[grpc.Future]:
        header = pb.WeightsHeader()
        header.CopyFrom(update.header)
        header.distributed.group = self.name
        header.distributed.bucket_bytes = plan.bucket_bytes
        header.distributed.contiguous = plan.run is not None
        return [
            client.weights_calls.start_small(
                list(update.messages(header, 0, plan.head_bytes)), timeout_s, request_id
            )
            for client in self.clients
        ]

    def _vote(self, calls: list[grpc.Future]) -> bool:
        """All ranks' vote; False (no broadcast) when a server refused."""
        flag = torch.tensor([_READY], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        work = self._process_groups[0].allreduce([flag], options)
        # Woken by the vote's end or by any call's end (no polling: a vote of a small update
        # is a fraction of a millisecond).
        woken, wake_s = threading.Event(), _REPLY_POLL_S
        try:
            work.get_future().add_done_callback(lambda _: woken.set())
        except (RuntimeError, NotImplementedError):  # a backend without futures: look often
            wake_s = 0.001
        for call in calls:
            call.add_done_callback(lambda _: woken.set())
        deadline = time.monotonic() + self._timeout_s
        while not work.is_completed():
            woken.clear()
            # A server that refuses votes first and then fails its call, so a failed call may
            # race its own vote: give the vote a moment. One that failed before it could vote
            # (an unknown group, say) never votes: then the group is out of step.
            if any(call.done() and call.exception() is not None for call in calls):
                deadline = min(deadline, time.monotonic() + _VOTE_GRACE_S)
            left_s = deadline - time.monotonic()
            if left_s < 0:
                failed = [c.exception() for c in calls if c.done() and c.exception() is not None]
                reason = f"a server failed before voting: {failed[0]}" if failed else "no vote"
                raise RuntimeError(f"{reason} (waited {self._timeout_s:g} s at most)")
            if not work.is_completed():
                woken.wait(min(left_s, wake_s))
        work.wait()
        return int(flag.item()) == _READY

    def _broadcast(self, plan: _BroadcastPlan, progress: Progress | None) -> None:
        """The data section in broadcasts of at most bucket_bytes (broadcast_spans: the servers
        post their receives with the same ranges), broadcast i over lane i % lanes, with up to
        two per lane in flight while the next is filled.

        A slice of a flattened data section (plan.run), or a range that lies inside one host
        tensor, is sent from the trainer's own memory; a pack of small tensors (or a GPU
        tensor's bytes under gloo) is filled into one of the fill buffers first (one per
        broadcast in flight, and the one being filled).
        """
        specs, sources = plan.specs, plan.sources
        ends = [spec.end for spec in specs]
        lanes = self._process_groups
        most_in_flight = _IN_FLIGHT_PER_LANE * len(lanes)
        buffers = BucketBuffers(plan.bucket_bytes, self.device, count=most_in_flight + 1)
        in_flight: collections.deque[tuple[dist.Work, int]] = collections.deque()
        for index, (begin, end) in enumerate(plan.spans):
            if plan.run is not None:
                bucket = plan.run[begin:end]
            else:
                fill = functools.partial(buffers.take, index)  # only a pack fills one
                bucket = _bucket(specs, sources, ends, begin, end, fill, self.device)
            in_flight.append((lanes[index % len(lanes)].broadcast(bucket, 0), end))
            if len(in_flight) > most_in_flight:
                _finish(in_flight.popleft(), progress, plan.head_bytes, plan.total_bytes)
        while in_flight:
            _finish(in_flight.popleft(), progress, plan.head_bytes, plan.total_bytes)

    def flatten_weights(self, weights: Mapping[str, torch.Tensor] | torch.nn.Module) -> None:
        """Make the weights live in one buffer laid out like the update's data section
        (flat_weights.py): later updates of them broadcast plain slices of it, with no copy and
        the fewest broadcasts. Call once, before training; see flatten_weights for tied
        weights."""
        flatten_weights(weights)

    def close(self) -> None:
        """Every server leaves the group (errors ignored: a dead server left already)."""
        for client in self.clients:
            try:
                client.weights_calls.destroy_weights_group(self.name, 10.0)
            except Exception:
                pass
        self._close_lanes()
        self._store = None  # the master's port closes

    def _break(self) -> None:
        """The collectives are out of step: no more updates through this group, and its lanes
        closed now, so that a server still waiting in a broadcast fails at once (its peer's
        connection closed) instead of at the group's timeout, holding its update lock."""
        self._broken = True
        self._close_lanes()

    def _close_lanes(self) -> None:
        lanes, self._process_groups = self._process_groups, ()  # see shut_down
        shut_down(lanes)

    def _replies(self, calls: list[grpc.Future]) -> list[pb.UpdateWeightsResponse]:
        """Every server's reply; else the error of the server that refused or failed first (not
        the "another rank refused" of the servers that only followed the vote).

        A server that died or dropped the group (its call ends UNAVAILABLE, or in another
        transport-level status) can leave the others waiting in a broadcast that will never
        complete (gloo's broadcast is a tree: ranks forward to ranks): the group is broken at
        once (`_break`), not after the others time out.
        """
        finished = threading.Event()
        for call in calls:
            call.add_done_callback(lambda _: finished.set())
        while True:
            if not self._broken and any(_member_lost(call) for call in calls if call.done()):
                self._break()
            if all(call.done() for call in calls):
                break
            finished.wait(_REPLY_POLL_S)
            finished.clear()
        replies, errors = [], []
        for call in calls:
            try:
                replies.append(call.result())
            except grpc.RpcError as error:
                errors.append(from_rpc_error(error))
        if errors:
            errors.sort(key=lambda error: _FOLLOWED_VOTE in str(error))
            raise errors[0]
        return replies

    def __enter__(self) -> WeightsGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class _BroadcastPlan:
    """What one update broadcasts: the tensors' bytes in file order and the ranges (spans)."""

    head_bytes: int
    total_bytes: int
    bucket_bytes: int
    specs: list[WeightSpec]
    sources: list[torch.Tensor]  # each tensor's bytes, flat uint8, on the group's device if GPU
    run: torch.Tensor | None  # the whole data section as one run of the trainer's memory
    spans: list[tuple[int, int]]

    @classmethod
    def of(
        cls, update: UpdateFile, device: torch.device, bucket_bytes: int | None
    ) -> _BroadcastPlan:
        head, specs = update.layout()
        data_bytes = specs[-1].end if specs else 0
        sources = [_as_bytes(update.state_dict[spec.name], device) for spec in specs]
        run = data_section_run(sources, specs, data_bytes)
        if run is not None and run.device.type != device.type:
            run = None  # a GPU trainer's weights under gloo: copied to the host in buckets
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES if run is None else CONTIGUOUS_BUCKET_BYTES
        tensors = [(spec.begin, spec.end) for spec in specs]
        try:
            spans = broadcast_spans(tensors, data_bytes, bucket_bytes, contiguous=run is not None)
        except ValueError as error:
            raise InvalidArgument(f"bucket_bytes: {error}") from None
        return cls(len(head), update.total_bytes, bucket_bytes, specs, sources, run, spans)


def _bucket(
    specs: Sequence[WeightSpec],
    sources: Sequence[torch.Tensor],
    ends: Sequence[int],
    begin: int,
    end: int,
    fill_buffer: Callable[[], torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """Data-section bytes [begin, end) on `device`: a view of one tensor's bytes, or a filled
    buffer."""
    first = bisect.bisect_right(ends, begin)
    spec = specs[first]
    inside = spec.begin <= begin and end <= spec.end
    if inside and sources[first].device.type == device.type:
        return sources[first][begin - spec.begin : end - spec.begin]  # the tensor's own memory
    bucket = fill_buffer()[: end - begin]
    index, position = first, begin
    while position < end:
        spec, source = specs[index], sources[index]
        take = min(end, spec.end) - position
        if take > 0:
            offset = position - spec.begin
            _copy_bytes(bucket[position - begin : position - begin + take],
                        source[offset : offset + take])  # fmt: skip
            position += take
        index += 1
    return bucket


def _finish(
    in_flight: tuple[dist.Work, int],
    progress: Progress | None,
    head_bytes: int,
    total_bytes: int,
) -> None:
    work, sent = in_flight
    work.wait()
    if progress is not None:
        progress(head_bytes + sent, total_bytes)


def _as_bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor's elements as a flat uint8 tensor (C order), on `device` if it is a GPU."""
    flat = tensor.detach().contiguous().reshape(-1)
    if device.type != "cpu":
        flat = flat.to(device)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _copy_bytes(destination: torch.Tensor, source: torch.Tensor) -> None:
    # numpy for host memory: torch's copy wakes its OpenMP pool, whose spinning threads take the
    # cores that gloo and the servers need (measured: many times the CPU of the copy itself).
    if destination.device.type == "cpu" and source.device.type == "cpu":
        np.copyto(destination.numpy(), source.numpy())
    else:
        destination.copy_(source)


def _member_lost(call: grpc.Future) -> bool:
    """Whether a finished call says its server left the group's collectives (died, timed out,
    dropped the group), as opposed to a deliberate refusal that kept it in step (a stale
    version before the vote, a bad value after the whole broadcast was taken)."""
    error = call.exception()
    return isinstance(error, grpc.RpcError) and error.code() in _LOST_CODES


def group_of(group: WeightsGroup | None, transport: str) -> WeightsGroup | None:
    """The group an update goes through (transport "dist", or "auto" with a group), None when it
    goes another way; InvalidArgument when transport and group disagree."""
    if group is None and transport != DIST:
        return None
    if group is None or transport not in (DIST, AUTO):
        raise InvalidArgument("transport 'dist' and group= go together (group: a WeightsGroup)")
    return group


class _OwnJoin:
    """This process's join as rank 0 (new_process_groups), on a daemon thread: a join that
    failed elsewhere is abandoned without keeping the interpreter from exiting."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.done = threading.Event()
        self.lanes: tuple[dist.ProcessGroup, ...] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(kwargs,), name="weights-group-join", daemon=True
        )
        self._thread.start()

    def _run(self, kwargs: dict[str, Any]) -> None:
        try:
            self.lanes = new_process_groups(**kwargs)
        except BaseException as error:
            self.error = error
        finally:
            self.done.set()

    def finish(self, within_s: float) -> None:
        """After a failure: wait (bounded) for the join to end, and shut down lanes it may have
        formed meanwhile."""
        self._thread.join(within_s)
        lanes, self.lanes = self.lanes, None
        if lanes:
            shut_down(lanes)


def _await_rendezvous(own: _OwnJoin, joins: Sequence[grpc.Future]) -> tuple[dist.ProcessGroup, ...]:
    """The lanes once this process and every server joined; the first failure at once: a
    server's refusal (typed) or this process's own join failing (Unavailable)."""
    changed = threading.Event()
    for join in joins:
        join.add_done_callback(lambda _: changed.set())
    while True:
        changed.clear()
        for join in joins:
            if join.done() and join.exception() is not None:
                raise from_rpc_error(join.exception())  # type: ignore[arg-type]
        if own.done.is_set():
            if own.error is not None:
                raise Unavailable(f"the rendezvous failed: {_first_line(own.error)}")
            if all(join.done() for join in joins):
                assert own.lanes is not None
                return own.lanes
        # Woken by a server's answer, or every poll interval for this process's own join.
        changed.wait(_REPLY_POLL_S)


def _first_line(error: BaseException) -> str:
    # c10d's messages carry a C++ stack trace after the first line.
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)
