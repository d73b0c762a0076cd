"""Parallel gRPC streams: one update's file spread over several UpdateWeights calls.

Every stream sends the same WeightsHeader with its own ParallelPart (index, byte range), then the
chunks of its range in order. Part 0, the leader, does what a single stream does (version check,
staging arena lease, head, swap) and registers an `Assembly`; the other parts join it by
update_id and write their ranges as lanes of the same stager (stream.py), each on its own gRPC
thread. The swap happens once every part arrived and verified, and every stream gets the same
reply; a failure of any part fails all of them and leaves the old weights serving.

Memory: one staging arena (held by the leader) plus one chunk in flight per stream.

Threads: a part whose leader has not registered yet (an unknown update_id) waits for it on its
gRPC handler thread, so those waits share a bounded pool of MAX_WAITING_PARTS; a part that finds
the pool full is RESOURCE_EXHAUSTED at once. Without it, 16 headers naming update_ids that never
come held all 16 handler threads for --parallel-part-wait-s, and Health timed out; the leader
takes one of the two update turns (update.py) like any upload. The pool holds the early parts of
a client's default parallel update (at most 8 streams) with room to spare. While a part waits, a
thread of its own reads the stream's next message (`_ReadAhead`): a caller that cancels, or whose
stream the idle deadline ends, makes that read fail or end, which ends the wait at once instead
of after --parallel-part-wait-s (the message read, if one comes, is the first the part then
stages). A server that stops ends every wait (`stop_waiting`).
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from ...client.protocol.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    RolloutError,
    Unavailable,
)
from ...v1 import rollout_pb2 as pb
from .staging import Request, UpdateStager, iter_chunks
from .stream import Lane

__all__ = [
    "MAX_STREAMS",
    "MAX_WAITING_PARTS",
    "Assembly",
    "ParallelUpdates",
    "check_part",
    "feed_part",
]

MAX_STREAMS = 64
MAX_WAITING_PARTS = 8  # parts waiting for their leader to register, all updates together
_UPDATE_ID = re.compile(r"[\x21-\x7e]{1,64}")
_REMEMBERED_FAILURES = 256
_FOLLOWER_RESULT_WAIT_S = 3600.0


def check_part(header: pb.WeightsHeader) -> pb.ParallelPart:
    """The header's ParallelPart, validated on its own (ranges are checked against the others)."""
    part = header.parallel
    if not _UPDATE_ID.fullmatch(part.update_id):
        raise InvalidArgument("header.parallel.update_id: 1 to 64 printable ASCII characters")
    if not 2 <= part.streams <= MAX_STREAMS:
        raise InvalidArgument(f"header.parallel.streams: 2 to {MAX_STREAMS}, got {part.streams}")
    if not 0 <= part.index < part.streams:
        raise InvalidArgument(f"header.parallel.index: 0 to {part.streams - 1}, got {part.index}")
    if not part.begin < part.end <= header.total_bytes:
        raise InvalidArgument(
            f"header.parallel: byte range [{part.begin}, {part.end}) is empty or runs past "
            f"total_bytes {header.total_bytes}"
        )
    if (part.index == 0) != (part.begin == 0):
        raise InvalidArgument("header.parallel: part 0, and only part 0, begins at byte 0")
    return part


def _without_part(header: pb.WeightsHeader) -> bytes:
    copy = pb.WeightsHeader()
    copy.CopyFrom(header)
    copy.ClearField("parallel")
    return copy.SerializeToString(deterministic=True)


def feed_part(lane: Lane, requests: Iterator[Request]) -> None:
    """Feed one stream's chunks into its lane; the stream must cover the lane's range exactly."""
    for offset, data, crc32 in iter_chunks(requests):
        lane.feed(offset, data, crc32)
    if not lane.complete:
        raise InvalidArgument(
            f"stream ended after {lane.position - lane.begin} of its part's "
            f"{lane.end - lane.begin} bytes"
        )


class Assembly:
    """One parallel update in flight: its stager, which parts are done, and the outcome."""

    def __init__(self, header: pb.WeightsHeader, stager: UpdateStager) -> None:
        self.stager = stager
        self.streams = header.parallel.streams
        self._header = _without_part(header)
        self._joined: set[int] = {0}
        self._done = 0
        self._error: RolloutError | None = None
        self._response: pb.UpdateWeightsResponse | None = None
        self._changed = threading.Condition()

    def join(self, header: pb.WeightsHeader) -> Lane:
        """A follower's lane, after checking its header equals the leader's."""
        part = header.parallel
        with self._changed:
            if self._error is not None:
                raise type(self._error)(str(self._error))
        if _without_part(header) != self._header:
            raise InvalidArgument(
                f"header.parallel.index {part.index}: the header differs from part 0's"
            )
        with self._changed:
            if part.index in self._joined:
                raise InvalidArgument(f"header.parallel.index {part.index} sent twice")
            self._joined.add(part.index)
        return self.stager.lane(part.begin, part.end)

    def part_done(self) -> None:
        with self._changed:
            self._done += 1
            self._changed.notify_all()

    def fail(self, error: BaseException, index: int) -> None:
        """Fail every part; the first failure names the status every stream reports."""
        with self._changed:
            if self._error is None:
                self._error = _as_rollout_error(error, index)
                self.stager.fail(self._error)
            self._changed.notify_all()

    def succeed(self, response: pb.UpdateWeightsResponse) -> None:
        with self._changed:
            self._response = response
            self._changed.notify_all()

    def wait_parts(self, timeout_s: float) -> None:
        """Leader: wait until every part arrived (raises the first part's failure)."""
        self._wait(lambda: self._done == self.streams, timeout_s, "every part to arrive")

    def wait_result(self, timeout_s: float) -> pb.UpdateWeightsResponse:
        """Follower: the leader's reply once the update is applied (or the failure)."""
        self._wait(lambda: self._response is not None, timeout_s, "the update to apply")
        assert self._response is not None
        return self._response

    def _wait(self, ready, timeout_s: float, what: str) -> None:  # noqa: ANN001 - a predicate
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._error is None and not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    error = DeadlineExceeded(
                        f"parallel update: waited {timeout_s:g} s for {what} "
                        f"({self._done} of {self.streams} parts done)"
                    )
                    self._error = error
                    self.stager.fail(error)
                    self._changed.notify_all()
                    break
                self._changed.wait(left)
            if self._error is not None:
                raise type(self._error)(str(self._error))


def _as_rollout_error(error: BaseException, index: int) -> RolloutError:
    if isinstance(error, RolloutError):
        return type(error)(f"part {index}: {error}")
    # A stream cut by its client (grpc raises from the request iterator) and the like.
    return InvalidArgument(f"part {index}: the stream broke off ({type(error).__name__})")


class ParallelUpdates:
    """The parallel updates in flight, by update_id, so that followers find their leader."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s  # how long a part waits for another (the leader, the other parts)
        self._assemblies: dict[str, Assembly] = {}
        self._failed: OrderedDict[str, Assembly] = OrderedDict()  # the latest failed updates
        self._changed = threading.Condition()
        self._waiting = 0  # parts waiting in `join` for their leader
        self._stopping = False  # the server stops: no part waits for its leader any more

    @property
    def waiting(self) -> int:
        """Parts waiting for their leader to register (at most MAX_WAITING_PARTS)."""
        with self._changed:
            return self._waiting

    def stop_waiting(self) -> None:
        """The server stops: parts waiting for their leader end now (UNAVAILABLE) instead of
        holding their handler threads for wait_s past the shutdown grace; later ones too."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    def open(self, header: pb.WeightsHeader, stager: UpdateStager) -> Assembly:
        """Leader: register the update (the caller calls `close` when it is over)."""
        update_id = header.parallel.update_id
        with self._changed:
            if update_id in self._assemblies or update_id in self._failed:
                raise InvalidArgument(f"header.parallel.update_id {update_id!r} is in use")
            assembly = self._assemblies[update_id] = Assembly(header, stager)
            self._changed.notify_all()
        return assembly

    def close(self, header: pb.WeightsHeader, error: BaseException | None = None) -> None:
        """Forget the update; a failed one is remembered a while, so that a part arriving after
        the failure gets its status at once instead of waiting wait_s for a leader."""
        update_id = header.parallel.update_id
        with self._changed:
            assembly = self._assemblies.pop(update_id, None)
            if error is not None and assembly is not None:
                self._failed[update_id] = assembly
                while len(self._failed) > _REMEMBERED_FAILURES:
                    self._failed.popitem(last=False)
            self._changed.notify_all()

    def join(
        self, header: pb.WeightsHeader, read_ahead: Callable[[], _ReadAhead] | None = None
    ) -> tuple[Assembly, _ReadAhead | None]:
        """Follower: the leader's assembly, waiting up to wait_s for part 0 to register it (in
        the bounded pool of waiting parts: RESOURCE_EXHAUSTED when it is full); while it waits,
        `read_ahead()` reads the stream's next message, and a failed read ends the wait."""
        update_id = header.parallel.update_id
        deadline = time.monotonic() + self.wait_s
        with self._changed:
            found = self._known(update_id)
            if found is not None:
                return found, None
            if self._waiting >= MAX_WAITING_PARTS:
                raise ResourceExhausted(
                    f"parallel update {update_id!r}: {MAX_WAITING_PARTS} parts are waiting for "
                    "their part 0 already; send part 0 first, or retry"
                )
            self._waiting += 1
            ahead = None if read_ahead is None else read_ahead()
            try:
                while (found := self._known(update_id)) is None:
                    if self._stopping:
                        raise Unavailable(f"parallel update {update_id!r}: the server is stopping")
                    if ahead is not None and ahead.ended:
                        ahead.raise_end(f"parallel update {update_id!r}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceeded(
                            f"parallel update {update_id!r}: part 0 did not start within "
                            f"{self.wait_s:g} s (or the update already ended)"
                        )
                    self._changed.wait(left)
                return found, ahead
            finally:
                self._waiting -= 1

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _known(self, update_id: str) -> Assembly | None:
        """The registered or recently failed assembly of update_id (joining a failed one raises
        its failure); the caller holds the condition."""
        return self._assemblies.get(update_id) or self._failed.get(update_id)

    def follow(
        self, header: pb.WeightsHeader, requests: Iterator[Request]
    ) -> pb.UpdateWeightsResponse:
        """Parts 1..N-1: write this stream's range into the leader's stager; the same reply."""
        index = header.parallel.index
        assembly, ahead = self.join(header, lambda: _ReadAhead(requests, self._wake))
        if ahead is not None:
            requests = ahead.then(requests)
        try:
            lane = assembly.join(header)
            lane.start_in_data(self.wait_s)
            feed_part(lane, requests)
            assembly.part_done()
        except BaseException as error:
            assembly.fail(error, index)
            raise
        # The leader resolves the assembly on every path (its reply or its error); the bound only
        # keeps a handler thread from waiting forever on a bug.
        return assembly.wait_result(_FOLLOWER_RESULT_WAIT_S)


class _ReadAhead:
    """The next message of a waiting part's stream, read on a thread of its own: the read fails
    when the caller cancels (or the stream's idle deadline ends it), which `ended` reports and
    `on_end` signals at once.

    A stream that ends there counts as ended too: a part's range is never empty, so a stream with
    nothing after its header is broken anyway, and grpc reports a cancel that way now and then
    (the receive completes empty before the call is marked cancelled, and the iterator stops
    instead of raising)."""

    def __init__(self, requests: Iterator[Request], on_end: Callable[[], None]) -> None:
        self._requests = requests
        self._on_end = on_end
        self._done = threading.Event()
        self._message: Request | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name="parallel-read-ahead", daemon=True)
        self._thread.start()

    @property
    def ended(self) -> bool:
        """The read failed, or the stream ended, with no message."""
        return self._done.is_set() and self._message is None

    def raise_end(self, what: str) -> None:
        """The status of a stream that ended while its part waited (the caller checked `ended`)."""
        if self._error is not None:
            raise Cancelled(f"{what}: the stream broke off while waiting for part 0")
        raise InvalidArgument(f"{what}: the stream ended after its header, with none of its bytes")

    def _read(self) -> None:
        try:
            self._message = next(self._requests, None)
        except BaseException as error:  # noqa: BLE001 - re-raised on the handler's thread
            self._error = error
        self._done.set()
        if self._message is None:
            self._on_end()

    def then(self, requests: Iterator[Request]) -> Iterator[Request]:
        """The message read ahead (waiting for the read), then the rest of the stream."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._message is None:  # the stream ended there
            return
        yield self._message
        yield from requests
