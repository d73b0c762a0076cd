"""The torch.distributed data plane: update files whose data section arrives by broadcast.

InitWeightsGroup joins this server to a trainer's process group (client/process_group.py), on
a thread of its own (_Join): its wait is capped by --max-group-timeout-s whatever timeout_s the
caller asks for, at most MAX_JOINING run at once, and a caller that leaves frees its handler
thread and its slot at once (the address it names is admin-chosen and may never answer; torch's
store client can wait on a silent listener for ever, so at most MAX_ABANDONED such threads are
left to end in their own time). An UpdateWeights call naming a DistributedSource (a stream, or one
UpdateWeightsAtOnce) carries the header and the file's head (the JSON header) as chunks; the server
checks the version and the head against its model, then every rank votes (an all-reduce MAX of 0 =
ready, 1 = refused) so that nobody starts a broadcast a server will not take; then rank 0
broadcasts the data section in ranges that follow the tensors (broadcast_spans), each received
straight into the staging arena (a lane of the same stager as every other transport; verified as it
lands) and taking the group's lanes (process groups over one rendezvous) in turn. Gloo receives
into a host arena; NCCL into the device arena of a CUDA server (arena.py), so its broadcast lands
on the GPU with no copy; gloo into a CUDA server goes through a host bucket and the pinned ring
(pipeline.py). One broadcast updates every server of the group.

A failure after the vote (a member died, a timeout) leaves the group's collectives out of step,
so the group is dropped: the next update naming it gets FAILED_PRECONDITION until the trainer
makes a new one. The old weights keep serving either way.
"""

from __future__ import annotations

import collections
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from ...client.protocol.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    RolloutError,
    Unavailable,
)
from ...client.protocol.process_group import (
    BACKENDS,
    DEFAULT_BUCKET_BYTES,
    MAX_LANES,
    BucketBuffers,
    all_max,
    broadcast_spans,
    new_process_groups,
    shut_down,
)
from ...v1 import rollout_pb2 as pb
from ..capture_guard import apart_from_captures
from .staging import Request, UpdateStager, receive_head_only
from .stream import Lane
from .timings import UpdateTimings

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MAX_GROUP_TIMEOUT_S",
    "MAX_ABANDONED",
    "MAX_JOINING",
    "WeightsGroup",
    "WeightsGroups",
]

_LOG = logging.getLogger(__name__)
MAX_BUCKET_BYTES = 1024 * 1024 * 1024
# Receives posted ahead of the one being checked, per lane (each a range of the arena, or a
# bounce buffer).
_POSTED_PER_LANE = 2
_GROUP_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_ADDRESS = re.compile(r"[A-Za-z0-9._:\[\]-]{1,255}")  # host names, IPv4, IPv6 (bracketed or not)
MAX_WORLD_SIZE = 4096  # a trainer and its servers; far above any real deployment
_READY, _REFUSED = 0, 1
# The rendezvous of InitWeightsGroup: its wait is capped server-side (--max-group-timeout-s),
# and at most MAX_JOINING run at once, each on its own daemon thread (see _Join).
DEFAULT_MAX_GROUP_TIMEOUT_S = 120.0
MAX_JOINING = 2
# Rendezvous threads whose caller left (or whose wait ran out) but that are still inside torch's
# blocking C++: they hold no slot of MAX_JOINING, but past this many InitWeightsGroup is refused.
MAX_ABANDONED = 8
_MASTER_RETRY_S = 0.2  # between connection attempts to a master that does not listen yet
# One attempt of the store's client: c10d's constructor retries a refused connection with
# backoff sleeps nothing can interrupt until its timeout, so each attempt gets this long and
# the caller leaving is checked between attempts (measured: 0.9 s for an attempt of 0.3 s
# toward a closed port, 1.7 s for 1 s).
_STORE_ATTEMPT_S = 1.0
_JOIN_MARGIN_S = 5.0  # a rendezvous may overrun its timeout by a little (c10d's last retry)


@dataclass
class WeightsGroup:
    """A process group this server joined, as rank `rank` of `world_size`, in `lanes` process
    groups (client/process_group.py: new_process_groups)."""

    name: str
    backend: str
    device: torch.device
    process_groups: tuple[dist.ProcessGroup, ...]  # the lanes
    rank: int
    world_size: int

    @property
    def process_group(self) -> dist.ProcessGroup:
        """Lane 0: the vote's."""
        return self.process_groups[0]


class WeightsGroups:
    """The groups of one server, by name."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # where NCCL broadcasts land (the models' device)
        self._groups: dict[str, WeightsGroup] = {}
        self._lock = threading.Lock()
        self._joining = threading.BoundedSemaphore(MAX_JOINING)  # rendezvous in flight
        self._joins: set[_Join] = set()  # hold a slot of _joining
        self._abandoned: set[_Join] = set()  # left by their callers, still in torch
        self._closed = False

    def init(
        self,
        request: pb.InitWeightsGroupRequest,
        *,
        max_timeout_s: float = DEFAULT_MAX_GROUP_TIMEOUT_S,
        on_cancel: Callable[[Callable[[], None]], bool] | None = None,
    ) -> pb.InitWeightsGroupResponse:
        """Join the trainer's group; blocks until every rank joined, the timeout (at most
        max_timeout_s, whatever the request asks), or the caller leaves.

        on_cancel(callback) registers a callback run when the caller leaves (gRPC's
        context.add_callback; False: it already left). The rendezvous runs on a thread of its
        own (_Join), so a caller that leaves frees its handler thread at once.
        """
        name, backend, timeout_s, lanes = _check_init(request, self.device)
        timeout_s = min(timeout_s, max_timeout_s)
        if not self._joining.acquire(blocking=False):
            raise ResourceExhausted(
                f"InitWeightsGroup: {MAX_JOINING} groups are being joined already; retry once "
                "they finish"
            )
        try:
            with self._lock:
                if self._closed:
                    raise Unavailable("the server is stopping")
                if len(self._abandoned) >= MAX_ABANDONED:
                    raise ResourceExhausted(
                        f"InitWeightsGroup: {len(self._abandoned)} abandoned rendezvous are "
                        "still waiting in torch.distributed for peers that do not answer; "
                        "retry once those peers close their connections"
                    )
                if name in self._groups:
                    raise FailedPrecondition(
                        f"group: {name!r} exists; DestroyWeightsGroup it first"
                    )
                self._groups[name] = None  # type: ignore[assignment]  # reserved while joining
        except BaseException:
            self._joining.release()
            raise
        join = _Join(self, request, backend, timeout_s, lanes)
        with self._lock:
            self._joins.add(join)
        try:
            join.thread.start()
        except RuntimeError:  # no thread to be had
            self._settle(join, None)
            raise ResourceExhausted("InitWeightsGroup: no thread for the rendezvous") from None
        if on_cancel is not None and not on_cancel(join.abandon):
            join.abandon()
        group = join.wait()
        _LOG.info("joined weights group %s (%s, rank %d of %d, %d lanes)", name, backend,
                  group.rank, group.world_size, lanes)  # fmt: skip
        return pb.InitWeightsGroupResponse(backend=backend, device=str(group.device), lanes=lanes)

    @property
    def joining(self) -> int:
        """Rendezvous a caller waits for (at most MAX_JOINING)."""
        with self._lock:
            return len(self._joins)

    @property
    def abandoned(self) -> int:
        """Rendezvous threads whose caller left, still in torch (at most MAX_ABANDONED)."""
        with self._lock:
            return len(self._abandoned)

    def _abandon(self, join: _Join) -> None:
        """Nobody waits for join any more: free its slot now; its thread ends in its own time
        (its name stays reserved until then, and a group it forms is shut down)."""
        with self._lock:
            if join not in self._joins:
                return  # settled first
            self._joins.discard(join)
            self._abandoned.add(join)
        self._joining.release()

    def _settle(self, join: _Join, group: WeightsGroup | None) -> bool:
        """The end of a join's thread: keep its group (unless closed or abandoned), or free its
        reserved name; free the join's slot unless _abandon did. Whether the group was kept."""
        name = join.name
        with self._lock:
            holds_slot = join in self._joins
            self._joins.discard(join)
            self._abandoned.discard(join)
            kept = group is not None and not self._closed
            if kept:
                self._groups[name] = group  # type: ignore[assignment]
            elif self._groups.get(name, False) is None:
                del self._groups[name]  # the reservation (close may have cleared it)
        if holds_slot:
            self._joining.release()
        return kept

    def destroy(self, name: str) -> None:
        with self._lock:
            group = self._groups.get(name)
            if group is None:
                raise _NotFound(f"group: no weights group {name!r}")
            del self._groups[name]
        _shutdown(group)

    def close(self, wait_s: float = 0.0) -> bool:
        """Leave every group; joins in flight are given up (a group they form is shut down).
        Waits up to wait_s for their threads to leave torch; whether they all did (one still
        inside when the interpreter finalizes aborts the process: the caller then leaves by
        os._exit, as for any work left behind)."""
        with self._lock:
            self._closed = True
            groups = [g for g in self._groups.values() if g is not None]
            self._groups.clear()
            joins = list(self._joins | self._abandoned)
        for join in joins:
            join.abandon()
        for group in groups:
            _shutdown(group)
        deadline = time.monotonic() + wait_s
        for join in joins:
            if join.thread.is_alive():  # (not yet started: init's own race with a stop)
                join.thread.join(max(deadline - time.monotonic(), 0.0))
        running = sum(join.thread.is_alive() for join in joins)
        if running:
            _LOG.warning(
                "%d weights-group rendezvous are still waiting in torch.distributed", running
            )
        return not running

    def get(self, name: str) -> WeightsGroup:
        with self._lock:
            group = self._groups.get(name)
        if group is None:
            raise FailedPrecondition(
                f"header.distributed.group: no weights group {name!r} on this server "
                "(InitWeightsGroup first; a group is dropped after a failed broadcast)"
            )
        return group

    def drop(self, group: WeightsGroup) -> None:
        """Forget a group whose collectives went out of step."""
        with self._lock:
            if self._groups.get(group.name) is group:
                del self._groups[group.name]
        _shutdown(group)


class _Join:
    """One InitWeightsGroup rendezvous, on a daemon thread of its own.

    The rendezvous is torch's blocking C++ (TCPStore, then each lane's process group), which
    nothing can interrupt; on a gRPC handler thread it held the thread until its timeout (up to
    an hour, even after the caller left, and a stuck non-daemon handler thread kept the process
    alive after SIGTERM). Here the handler waits on an event that the rendezvous or the caller
    leaving sets, and returns at once when the caller leaves. The thread first connects to the
    master's store itself, retrying every _MASTER_RETRY_S until the timeout, so a join toward a
    port nobody listens on ends as soon as its caller leaves; past that, it ends by the timeout.
    A group that forms after its caller left is shut down, not kept.
    """

    def __init__(
        self,
        groups: WeightsGroups,
        request: pb.InitWeightsGroupRequest,
        backend: str,
        timeout_s: float,
        lanes: int,
    ) -> None:
        self._groups = groups
        self.name = request.group
        self._request = request
        self._backend = backend
        self._timeout_s = timeout_s
        self._lanes = lanes
        self._deadline = time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._left = threading.Event()  # the caller left: stop trying
        self._wake = threading.Event()  # the rendezvous ended or the caller left
        self._result: WeightsGroup | RolloutError | None = None
        self.thread = threading.Thread(
            target=self.run, name=f"weights-group-{self.name}", daemon=True
        )

    def run(self) -> None:
        """The join thread: rendezvous, then keep the group unless the caller left."""
        result = self._rendezvous()
        with self._lock:
            keep = isinstance(result, WeightsGroup) and not self._left.is_set()
            self._result = result
        kept = self._groups._settle(self, result if keep else None)  # type: ignore[arg-type]
        if isinstance(result, WeightsGroup) and not kept:
            _shutdown(result)
        self._wake.set()

    def abandon(self) -> None:
        """The caller left (gRPC's callback thread, or the handler after its bound)."""
        with self._lock:
            left = self._result is None
            if left:
                self._left.set()
        self._wake.set()
        if left:
            self._groups._abandon(self)

    def wait(self) -> WeightsGroup:
        """The joined group, or the error to answer with."""
        self._wake.wait(self._timeout_s + _JOIN_MARGIN_S)
        with self._lock:
            result = self._result
            if result is None:
                self._left.set()  # run() drops the group should it still form
        if result is None:
            self._groups._abandon(self)
        if isinstance(result, WeightsGroup):
            return result
        if isinstance(result, RolloutError):
            raise result
        if self._wake.is_set():  # woken by abandon: the caller left
            raise Cancelled("InitWeightsGroup: the caller left; the join is abandoned")
        raise DeadlineExceeded(
            f"group {self._request.group!r}: the rendezvous did not end within "
            f"{self._timeout_s:g} s (timeout_s, capped by --max-group-timeout-s)"
        )

    def _rendezvous(self) -> WeightsGroup | RolloutError:
        request = self._request
        try:
            store = self._connect_store()
            process_groups = new_process_groups(
                group=request.group,
                master_address=request.master_address,
                master_port=request.master_port,
                world_size=request.world_size,
                rank=request.rank,
                backend=self._backend,
                timeout_s=max(self._deadline - time.monotonic(), 0.001),
                lanes=self._lanes,
                store=store,
            )
        except RolloutError as error:
            return error
        except Exception as error:
            # c10d's messages carry a C++ stack trace after the first line.
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            return Unavailable(
                f"group {request.group!r}: rendezvous failed within {self._timeout_s:g} s "
                f"(timeout_s, capped by --max-group-timeout-s): {reason}"
            )
        device = self._groups.device if self._backend == "nccl" else torch.device("cpu")
        return WeightsGroup(
            request.group, self._backend, device, process_groups, request.rank,
            request.world_size,
        )  # fmt: skip

    def _connect_store(self) -> dist.TCPStore:
        """The master's store, as its client, retried every _MASTER_RETRY_S until the deadline
        (Unavailable) or the caller leaving (Cancelled). An attempt first checks that the master
        accepts a connection (a plain socket, closed at once: quick and quiet while the trainer
        has not opened its store yet), then gives torch's client at most _STORE_ATTEMPT_S, so a
        master that closes while we connect (its trainer gave the group up) ends the join soon
        after its caller leaves, not at the timeout. The store then waits up to the deadline."""
        request = self._request
        address = (request.master_address.strip("[]"), request.master_port)
        accepted = False  # the master accepted a connection once: its store failed to answer
        while not self._left.is_set():
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                what = "the store did not answer" if accepted else "nothing accepted connections"
                raise Unavailable(
                    f"group {request.group!r}: rendezvous failed: {what} at "
                    f"{request.master_address}:{request.master_port} within "
                    f"{self._timeout_s:g} s (timeout_s, capped by --max-group-timeout-s)"
                )
            try:
                with socket.create_connection(address, timeout=min(remaining, 1.0)):
                    accepted = True
                store = dist.TCPStore(
                    request.master_address, request.master_port, request.world_size,
                    is_master=False, timeout=timedelta(seconds=min(remaining, _STORE_ATTEMPT_S)),
                )  # fmt: skip
            except (OSError, RuntimeError):  # refused, or c10d's DistNetworkError and kin
                self._left.wait(min(_MASTER_RETRY_S, remaining))
                continue
            store.set_timeout(timedelta(seconds=max(self._deadline - time.monotonic(), 0.001)))
            return store
        raise Cancelled("InitWeightsGroup: the caller left")


class _NotFound(RolloutError):
    code = grpc.StatusCode.NOT_FOUND


def _check_init(
    request: pb.InitWeightsGroupRequest, device: torch.device
) -> tuple[str, str, float, int]:
    if not _GROUP_NAME.fullmatch(request.group):
        raise InvalidArgument("group: 1 to 64 characters of [A-Za-z0-9._-]")
    if not _ADDRESS.fullmatch(request.master_address):
        raise InvalidArgument("master_address: a host name or IP address (1 to 255 characters)")
    if not 0 < request.master_port < 65536:
        raise InvalidArgument(f"master_port: 1 to 65535, got {request.master_port}")
    if not 2 <= request.world_size <= MAX_WORLD_SIZE:
        raise InvalidArgument(f"world_size: 2 to {MAX_WORLD_SIZE}, got {request.world_size}")
    if not 0 < request.rank < request.world_size:
        raise InvalidArgument(
            f"rank: 1 to {request.world_size - 1} (rank 0 is the trainer), got {request.rank}"
        )
    backend = request.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend: one of {', '.join(BACKENDS)}, got {request.backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise FailedPrecondition("backend: nccl needs a server whose models are on a CUDA device")
    timeout_s = request.timeout_s or 60.0
    if not 0 < timeout_s <= 3600:
        raise InvalidArgument(f"timeout_s: 0 (60 s) or up to 3600, got {request.timeout_s}")
    lanes = request.lanes or 1
    if not 1 <= lanes <= MAX_LANES:
        raise InvalidArgument(f"lanes: 0 (1) or 1 to {MAX_LANES}, got {request.lanes}")
    return request.group, backend, timeout_s, lanes


def _writes_to(backend_device: torch.device, arena_device: torch.device) -> bool:
    """Whether a group whose receives land on backend_device can receive into arena_device
    (a device without an index is the current one)."""
    if backend_device.type != arena_device.type:
        return False
    if backend_device.type == "cpu" or backend_device.index == arena_device.index:
        return True
    return backend_device.index is None and arena_device.index == torch.cuda.current_device()


def _shutdown(group: WeightsGroup) -> None:
    lanes, group.process_groups = group.process_groups, ()  # see shut_down
    shut_down(lanes)


class GroupUpdate:
    """One update through a group: the vote, then the broadcast into the stager's lane.

    Used as a context manager around everything the server does for the update between reading
    the header and the swap, so that a refusal before the vote (stale version, a head that does
    not match the model) still casts the vote the other ranks wait for.
    """

    def __init__(self, groups: WeightsGroups, source: pb.DistributedSource) -> None:
        self._groups = groups
        self._group = groups.get(source.group)
        bucket_bytes = source.bucket_bytes or DEFAULT_BUCKET_BYTES
        if not 0 < bucket_bytes <= MAX_BUCKET_BYTES:
            raise InvalidArgument(
                f"header.distributed.bucket_bytes: up to {MAX_BUCKET_BYTES}, got {bucket_bytes}"
            )
        self._bucket_bytes = bucket_bytes
        self._contiguous = source.contiguous
        self._voted = False

    def __enter__(self) -> GroupUpdate:
        return self  # one update at a time already: the update lock (update.py)

    def __exit__(self, exc_type: object, error: BaseException | None, tb: object) -> None:
        if error is not None and not self._voted:
            # A collective on the group's device (NCCL: on the GPU): apart from any capture.
            with apart_from_captures(self._group.device):
                self._vote(_REFUSED)

    def receive(self, stager: UpdateStager, requests: Iterator[Request]) -> None:
        """The head from the stream, the vote, then the data section by broadcast."""
        lane = receive_head_only(stager, requests, "distributed")
        spans = self._spans(lane)  # a refusal here still votes (no broadcast starts)
        if not self._vote(_READY):
            raise FailedPrecondition("another rank of the group refused this update")
        failure, refusal = None, None
        try:
            refusal = self._receive_buckets(lane, spans, stager.timings)
        except Exception as error:
            failure = str(error)
        if failure is not None:  # outside the except block: see _out_of_step
            raise self._out_of_step("the broadcast", failure)
        if refusal is not None:
            raise refusal

    def _spans(self, lane: Lane) -> list[tuple[int, int]]:
        """(file offset, size) of every broadcast of the data section, as rank 0 cuts it."""
        data = lane.file_data
        tensors = [(entry.begin, entry.end) for entry in data.entries]
        data_bytes = lane.end - data.data_start
        try:
            spans = broadcast_spans(
                tensors, data_bytes, self._bucket_bytes, contiguous=self._contiguous
            )
        except ValueError as error:
            raise InvalidArgument(f"header.distributed.bucket_bytes: {error}") from None
        return [(data.data_start + begin, end - begin) for begin, end in spans]

    def _receive_buckets(
        self, lane: Lane, spans: list[tuple[int, int]], timings: UpdateTimings
    ) -> RolloutError | None:
        """Every broadcast of the data section (broadcast_spans; broadcast i over lane
        i % lanes), each checked while the next _POSTED_PER_LANE x lanes are being received
        (gloo runs posted receives in its own threads, and the trainer keeps as many
        broadcasts in flight). Returns the first value error:
        after one, the rest of the broadcast is still taken (rank 0 and the other servers must
        not hang on a rank that stopped listening), but not kept. The waits for each broadcast
        add up in `timings` (broadcast_wait), apart from the work on what arrived."""
        group = self._group
        lanes = group.process_groups
        ahead = _POSTED_PER_LANE * len(lanes)
        bounce = BucketBuffers(self._bucket_bytes, group.device, count=ahead + 1)
        refusal: RolloutError | None = None

        def post(index: int) -> tuple[dist.Work, torch.Tensor, bool]:
            position, size = spans[index]
            # Straight into the arena when the bytes are one run there (the common case) and
            # the arena is where the backend writes (gloo: a host arena; NCCL: a device arena,
            # so a CUDA server's broadcast lands on its GPU with no copy at all); else into a
            # bounce buffer that `feed` copies from.
            direct = lane.destination(position, size) if refusal is None else None
            if direct is not None and not _writes_to(group.device, direct.device):
                direct = None
            target = direct if direct is not None else bounce.take(index)[:size]
            work = lanes[index % len(lanes)].broadcast(target, 0)
            return work, target, direct is not None

        posted = collections.deque(post(i) for i in range(min(ahead, len(spans))))
        waited_s = 0.0
        for index, (position, size) in enumerate(spans):
            work, received, direct = posted.popleft()
            asked_s = time.perf_counter()
            work.wait()
            waited_s += time.perf_counter() - asked_s
            if index + ahead < len(spans):
                posted.append(post(index + ahead))
            if refusal is not None:
                continue
            try:
                if direct:
                    lane.commit(size)
                else:
                    lane.feed(position, received.cpu().numpy())
            except RolloutError as error:
                refusal = error
        timings.add("broadcast_wait", waited_s, len(spans))
        return refusal

    def _vote(self, vote: int) -> bool:
        self._voted = True
        failure = None
        try:
            return all_max(self._group.process_group, vote, self._group.device) == _READY
        except Exception as error:
            failure = str(error)
        raise self._out_of_step("the vote before the broadcast", failure)

    def _out_of_step(self, what: str, error: str) -> Unavailable:
        """A failed collective (a rank died, a timeout): drop the group; the status to raise.

        Called outside the except block of the failure, whose traceback would keep the
        receiving frames, and with them the lanes, alive: dropping the group destroys its
        process groups, and only that closes gloo's connections, so the other ranks fail at
        once instead of waiting for their timeout."""
        self._groups.drop(self._group)
        return Unavailable(
            f"group {self._group.name!r}: {what} failed ({error}); the group is dropped, make a "
            "new one"
        )
