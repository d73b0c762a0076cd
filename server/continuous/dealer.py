"""The dealer: made batches wait in a bounded queue and go round-robin to a ring of subscribers.

Dealing: subscribers form a ring in the order they joined and batches go round-robin: batch k
waits for the subscriber whose turn it is (a trainer that takes its batches slowly slows the
ring rather than being skipped, as in ColossalChat), but only while that subscriber is waiting
for a batch or has been away for less than `turn_wait_s` (TURN_WAIT_S). One that stays away
longer (its handler is stuck sending to a client that does not read) loses its turn, and every
turn until it waits again: the batch goes to the next subscriber in the ring that is there, so
one stuck reader no longer stops the rollout for the others; the server's send deadline
(--stream-send-timeout-s) then ends its stream, and it leaves the ring. A subscriber that
leaves (cancel, disconnect, max_batches) leaves the ring at once; a batch dealt to a call that is
already over goes back to the front of the queue, and queued batches wait for the next
subscriber. A batch counts as delivered once it is handed to gRPC on a live call; gRPC may still
hold it in network buffers, so a subscriber that dies at that instant loses it. batch_index
numbers the delivered batches from 0 across all subscribers, without gaps.

Credit windows: a subscriber with a window (SubscribeRequest.window >= 1) is handed at most
`window` batches it has not acknowledged (`acknowledge`, as its trainer takes them); at its
limit it is not ready, and, like one away from the dealer, it keeps its turn for `turn_wait_s`
after its last batch. A subscriber without one (window None: a client from before windows
existed) is ready whenever its handler is back for a batch, as before; gRPC's buffers then decide
how far ahead of its trainer it runs.

Back-pressure: the loop makes a batch only while a subscriber is connected and the queue holds
fewer than its lookahead (wait_for_demand): `capacity` batches, and, when every subscriber has a
window, no more than one per subscriber: the batch it takes next, made while its trainer trains
on the last one. Deeper, the queue would only hold batches that go stale before anyone can take
them (a trainer that pushes weights after every batch makes a batch queued behind another one
stale), and the loop would make them again and again. So, while nothing is dropped, at most
taken + windows + lookahead batches are ever made. A subscriber without a window lets the queue
fill to `capacity`, as before windows.

Staleness: a batch whose policy_version is below (newest actor version - max_staleness) is
dropped, not sent, and counted. The check runs when a batch is handed over and when the loop looks
for room, never on a batch already handed over. Default 1: a batch may come from the previous
weights, so making overlaps training by one step (one-step off-policy, as in async PPO); None
("unlimited") turns the check off.

End: once the loop has finished and the queue is empty every stream ends normally (OK), also for
late subscribers; close() (the server shutting down) ends them with UNAVAILABLE.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ...client.protocol.errors import InvalidArgument, RolloutError, Unavailable
from ...v1 import rollout_pb2 as pb

__all__ = ["MAX_WINDOW", "TURN_WAIT_S", "Dealer", "MadeBatch", "Subscription"]

_LOG = logging.getLogger(__name__)
# How long a subscriber that is away (sending its last batch) keeps its turn: far above the time
# a reading client's send takes, far below the send deadline that ends a stuck one.
TURN_WAIT_S = 1.0
# The largest credit window a subscriber may ask for: batches handed over but not yet taken are
# memory on both sides and versions of lag for the trainer.
MAX_WINDOW = 16


@dataclass(frozen=True)
class MadeBatch:
    """A made batch waiting in the queue; batch_index is set when it is dealt."""

    response: pb.SubscribeResponse
    policy_version: int


class Subscription:
    """One Subscribe call: iterate it for the responses to send; `cancel()` when the call ends."""

    def __init__(
        self,
        dealer: Dealer,
        name: str,
        max_batches: int,
        is_live: Callable[[], bool],
        window: int | None = None,
    ) -> None:
        self.name = name
        self.remaining: int | None = max_batches or None  # None: until the rollout ends
        self.received = 0
        self.gone = False
        self.is_live = is_live
        self.window = window  # None: no acknowledgements (every handed batch counts as taken)
        self.unacknowledged = 0  # handed over, not yet acknowledged (with a window)
        self.acks_closed = False  # the client said it acknowledges no more
        self.error: RolloutError | None = None  # a bad acknowledgement: ends the call
        self.waiting = False  # inside Dealer.take
        self.away_since = time.monotonic()  # when it last left Dealer.take (or joined)
        self._dealer = dealer

    @property
    def has_room(self) -> bool:
        """Whether its window lets the dealer hand it one more batch."""
        return self.window is None or self.unacknowledged < self.window

    @property
    def ready(self) -> bool:
        """Waiting in Dealer.take with room in its window: the next batch can go to it now."""
        return self.waiting and self.has_room

    def __iter__(self) -> Iterator[pb.SubscribeResponse]:
        try:
            while (response := self._dealer.take(self)) is not None:
                yield response
        finally:
            self._dealer.leave(self)

    def cancel(self) -> None:
        """The call is over (client gone, deadline): leave the ring now; idempotent."""
        self._dealer.leave(self)

    def acknowledge(self, taken: int) -> None:
        """The trainer took `taken` more batches: that many more may be handed over."""
        self._dealer.acknowledge(self, taken)

    def close_acknowledgements(self) -> None:
        """No acknowledgement will come any more: the stream ends once the window is used up."""
        self._dealer.close_acknowledgements(self)

    def fail(self, error: RolloutError) -> None:
        """End the call with `error` (raised from its iteration)."""
        self._dealer.fail(self, error)


class Dealer:
    """Made batches waiting in a bounded queue, dealt round-robin to a ring of subscribers."""

    def __init__(
        self,
        *,
        capacity: int,
        newest_version: Callable[[], int],
        max_staleness: int | None,
        turn_wait_s: float = TURN_WAIT_S,
    ) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[MadeBatch] = collections.deque()
        self._ring: list[Subscription] = []
        self._turn = 0  # index in _ring of the subscriber the next batch goes to
        self._turn_wait_s = turn_wait_s
        self._capacity = capacity
        self._newest_version = newest_version
        self._max_staleness = max_staleness
        self._done = False  # the loop made its last batch
        self._closed = False
        self._delivered = 0
        self._dropped_stale = 0

    # ---- the subscriber side --------------------------------------------------------------

    def join(
        self,
        name: str,
        max_batches: int,
        is_live: Callable[[], bool],
        window: int | None = None,
    ) -> Subscription:
        """A new subscriber at the end of the ring; `window` None: no acknowledgements."""
        if window is not None and not 1 <= window <= MAX_WINDOW:
            raise InvalidArgument(f"window: must be 1 to {MAX_WINDOW} (or 0: none), got {window}")
        subscription = Subscription(self, name, max_batches, is_live, window)
        with self._cond:
            self._ring.append(subscription)
            self._cond.notify_all()  # demand: the loop may start making
            _LOG.info(
                "subscriber %s joined (window %s; %d connected)",
                name,
                "none" if window is None else window,
                len(self._ring),
            )
        return subscription

    def acknowledge(self, sub: Subscription, taken: int) -> None:
        """`sub`'s trainer took `taken` more batches; InvalidArgument for more than it has."""
        with self._cond:
            if sub.window is None:
                raise InvalidArgument("taken: this subscription has no window (window 0)")
            if not 1 <= taken <= sub.unacknowledged:
                raise InvalidArgument(
                    f"taken: must be 1 to the {sub.unacknowledged} batches handed over and not "
                    f"yet acknowledged, got {taken}"
                )
            sub.unacknowledged -= taken
            self._cond.notify_all()  # room in its window

    def close_acknowledgements(self, sub: Subscription) -> None:
        with self._cond:
            sub.acks_closed = True
            self._cond.notify_all()

    def fail(self, sub: Subscription, error: RolloutError) -> None:
        with self._cond:
            if sub.error is None:
                sub.error = error
            self._cond.notify_all()

    def leave(self, sub: Subscription) -> None:
        with self._cond:
            if not sub.gone:
                self._leave_locked(sub)

    def _leave_locked(self, sub: Subscription) -> None:
        sub.gone = True
        index = self._ring.index(sub)
        del self._ring[index]
        if index < self._turn:
            self._turn -= 1
        if self._turn >= len(self._ring):
            self._turn = 0
        self._cond.notify_all()
        _LOG.info(
            "subscriber %s left after %d batches (%d connected)",
            sub.name,
            sub.received,
            len(self._ring),
        )

    def take(self, sub: Subscription) -> pb.SubscribeResponse | None:
        """Block until it is `sub`'s turn and a fresh batch waits; None when its stream ends."""
        with self._cond:
            sub.waiting = True
            try:
                return self._take_locked(sub)
            finally:
                sub.waiting = False
                sub.away_since = time.monotonic()

    def _take_locked(self, sub: Subscription) -> pb.SubscribeResponse | None:
        while True:
            if self._closed:
                raise Unavailable("the server is shutting down; the rollout stopped")
            if sub.error is not None:
                raise sub.error
            if sub.gone or sub.remaining == 0:
                return None
            if not sub.has_room and sub.acks_closed:  # no credit will ever come: the end
                return None
            self._drop_stale_locked()  # at hand-over: a batch that went stale while queued
            recheck_s = None
            if self._queue and sub.has_room:
                holder, recheck_s = self._turn_holder_locked()
                if holder is sub:
                    return self._deal_locked(sub)
            if self._done and not self._queue:
                return None
            self._cond.wait(recheck_s)  # a timeout when the holder may lose its turn by then

    def _turn_holder_locked(self) -> tuple[Subscription | None, float | None]:
        """Who the next batch goes to: the subscriber whose turn it is, unless it has been away
        for turn_wait_s or more, then the next one in the ring that is not. (None, seconds
        until the holder would lose its turn) while the holder is away but may come back."""
        now = time.monotonic()
        for step in range(len(self._ring)):
            candidate = self._ring[(self._turn + step) % len(self._ring)]
            if candidate.ready:
                return candidate, None
            away_s = now - candidate.away_since
            if away_s < self._turn_wait_s:
                return None, self._turn_wait_s - away_s
            # Away too long (stuck sending to a client that does not read, or a trainer that
            # has not taken its window): it loses its turn.
        return None, None

    def _deal_locked(self, sub: Subscription) -> pb.SubscribeResponse | None:
        batch = self._queue.popleft()
        if not sub.is_live():  # gone before the cancel callback ran: the batch waits for others
            self._queue.appendleft(batch)
            self._leave_locked(sub)
            return None
        response = batch.response
        response.batch_index = self._delivered
        self._delivered += 1
        sub.received += 1
        if sub.window is not None:
            sub.unacknowledged += 1
        self._turn = (self._ring.index(sub) + 1) % len(self._ring)  # past any that lost theirs
        if sub.remaining is not None:
            sub.remaining -= 1
            if sub.remaining == 0:  # done: the next batches go to the others
                self._leave_locked(sub)
        self._cond.notify_all()  # room in the queue, and someone else's turn
        return response

    def _drop_stale_locked(self) -> None:
        if self._max_staleness is None or not self._queue:
            return
        oldest_fresh = self._newest_version() - self._max_staleness
        fresh = [batch for batch in self._queue if batch.policy_version >= oldest_fresh]
        dropped = len(self._queue) - len(fresh)
        if dropped:
            self._dropped_stale += dropped
            self._queue = collections.deque(fresh)
            self._cond.notify_all()
            _LOG.info(
                "dropped %d rollout batches older than policy version %d", dropped, oldest_fresh
            )

    # ---- the loop side --------------------------------------------------------------------

    def wait_for_demand(self, can_make: Callable[[], bool]) -> bool:
        """Block until a subscriber is connected, the queue has room and `can_make()`.

        False when the dealer was closed.
        """
        with self._cond:
            while not self._closed:
                self._drop_stale_locked()
                if self._ring and len(self._queue) < self._lookahead_locked() and can_make():
                    return True
                self._cond.wait()
        return False

    def _lookahead_locked(self) -> int:
        """How many made batches may wait: `capacity`, and one per subscriber when every
        subscriber has a window (see Back-pressure above)."""
        if any(sub.window is None for sub in self._ring):
            return self._capacity
        return min(self._capacity, len(self._ring))

    def put(self, batch: MadeBatch) -> None:
        with self._cond:
            self._queue.append(batch)
            self._cond.notify_all()

    def notify(self) -> None:
        """Wake every waiter to re-check its condition (the server's phase changed)."""
        with self._cond:
            self._cond.notify_all()

    def finish(self) -> None:
        """No more batches will come: streams end once the queue is empty."""
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def close(self) -> None:
        """The server stops: waiting streams end with UNAVAILABLE."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def counts(self) -> tuple[bool, int, int, int, int]:
        """(finished, delivered, dropped_stale, queued, subscribers), read together."""
        with self._cond:
            finished = self._done and not self._queue
            delivered, dropped = self._delivered, self._dropped_stale
            return finished, delivered, dropped, len(self._queue), len(self._ring)
