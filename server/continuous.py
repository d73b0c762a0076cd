"""Continuous rollout: the server reads a prompt source, keeps making experience while trainers
are subscribed, and deals each batch to exactly one of them (ColossalChat's
ExperienceMakerHolder over gRPC, without Ray). The Subscribe RPC and Health.rollout expose it.

Prompt source (--rollout-prompts FILE.jsonl): one JSON object per line, {"prompt": str} or
{"prompt_ids": [int, ...]}, each with an optional "gt_answer": str; every line of one kind; blank
lines are skipped and other keys ignored. A prompt's id is its row among the prompts (0-based,
blank lines not counted); it travels in Experience.prompt_index.

Schedule: every epoch visits each prompt once, in an order shuffled by a generator seeded with
(--rollout-seed, epoch); consecutive runs of --rollout-prompts-per-batch prompts form a batch (the
last one of an epoch may be smaller: batches never span epochs, so every prompt is made exactly
once per epoch). The rollout ends after --rollout-epochs epochs or --rollout-steps batches,
whichever comes first (0: no limit; both 0: it runs until the server stops).

One batch is one MakeExperienceRequest: the --rollout-request template (protobuf JSON without
prompts or gt_answers; empty: every default) plus the batch's prompts and answers (an empty
answer for a prompt without one when the source has any), a sampling seed derived from the
template's seed (else --rollout-seed) and the step, and request_id "rollout-<step>". Its
micro-batches travel as one SubscribeResponse (micro_batch_size is set to the whole batch). The
template is checked at start-up by decoding the first batch, so a bad one fails the start.

Loop: one thread makes one batch at a time on the engine, so weight updates (engine jobs too)
swap between batches and every batch is made by one policy version, read on the engine thread.
It makes a batch only while at least one subscriber is connected (demand), the queue holds fewer
than --rollout-queue-batches batches (back-pressure: memory stays bounded) and the server serves
(not while it waits for weights). A batch that fails (a prompt too long for the context, a reward
source error) is logged, counted as failed and skipped.

Dealing: subscribers form a ring in the order they joined and batches go strictly round-robin:
batch k waits for the subscriber whose turn it is (a slow trainer slows the ring rather than
being skipped, as in ColossalChat). A subscriber that leaves (cancel, disconnect, max_batches)
leaves the ring at once; a batch dealt to a call that is already over goes back to the front of
the queue, and queued batches wait for the next subscriber. A batch counts as delivered once it
is handed to gRPC on a live call; gRPC may still hold it in network buffers, so a subscriber that
dies at that instant loses it (the contract has no acknowledgements). batch_index numbers the
delivered batches from 0 across all subscribers, without gaps.

Staleness: a batch whose policy_version is below (newest actor version - --max-staleness) is
dropped, not sent, and counted. The check runs when a batch is dealt and when the loop looks for
room. Default 1: a batch may come from the previous weights, so making overlaps training by one
step (one-step off-policy, as in async PPO); "unlimited" turns the check off.

End: once the schedule is done and the queue is empty every stream ends normally (OK), also for
late subscribers; a server shutting down ends them with UNAVAILABLE.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from google.protobuf import json_format
from rollserve.client.errors import ResourceExhausted, RolloutError, Unavailable
from rollserve.client.experience import Experience, concat_experiences, experience_to_proto
from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelLoadError, Phase, ServerState
from rollserve.v1 import rollout_pb2 as pb

if TYPE_CHECKING:
    from rollserve.server.experience_request import ExperienceSpec
    from rollserve.server.runtime import Runtime

__all__ = [
    "ContinuousRollout",
    "Dealer",
    "MadeBatch",
    "PlannedBatch",
    "PromptSource",
    "RolloutSettings",
    "RolloutSetupError",
    "RolloutStats",
    "SourcePrompt",
    "Subscription",
    "build_batch_request",
    "load_prompt_source",
    "load_request_template",
    "plan_batches",
]

_LOG = logging.getLogger(__name__)
_SEED_MASK = (1 << 63) - 1
_MAKING_PHASES = (Phase.SERVING, Phase.DRAINING)  # the phases MakeExperience serves in


class RolloutSetupError(ModelLoadError):
    """A prompt source or request template the server cannot use; fails the start like a model
    that cannot load (the CLI prints it without a traceback)."""


# ---- prompt source and schedule ---------------------------------------------------------------


@dataclass(frozen=True)
class SourcePrompt:
    """One prompt of the source: text or token ids, and its ground-truth answer if any."""

    row: int  # the prompt id: its row among the prompts, from 0
    text: str | None
    token_ids: tuple[int, ...] | None
    gt_answer: str | None


@dataclass(frozen=True)
class PromptSource:
    """Every prompt of a JSONL file, all text or all token ids."""

    prompts: tuple[SourcePrompt, ...]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def is_text(self) -> bool:
        return self.prompts[0].text is not None

    @property
    def has_gt_answers(self) -> bool:
        return any(p.gt_answer is not None for p in self.prompts)


def load_prompt_source(path: str | Path) -> PromptSource:
    """Read a JSONL prompt file; RolloutSetupError naming the line of the first bad one."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise RolloutSetupError(f"cannot read the rollout prompts {path}: {exc}") from None
    prompts: list[SourcePrompt] = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            prompts.append(_parse_prompt(line, row=len(prompts), where=f"{path}:{number}"))
    if not prompts:
        raise RolloutSetupError(f"{path}: no prompts")
    if len({p.text is None for p in prompts}) > 1:
        raise RolloutSetupError(f"{path}: mixes prompt and prompt_ids lines; use one kind")
    return PromptSource(tuple(prompts))


def _parse_prompt(line: str, *, row: int, where: str) -> SourcePrompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RolloutSetupError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(item, dict) or ("prompt" in item) == ("prompt_ids" in item):
        raise RolloutSetupError(f"{where}: expected an object with one of prompt, prompt_ids")
    gt_answer = item.get("gt_answer")
    if gt_answer is not None and not isinstance(gt_answer, str):
        raise RolloutSetupError(f"{where}: gt_answer must be a string")
    if "prompt" in item:
        text = item["prompt"]
        if not isinstance(text, str) or not text:
            raise RolloutSetupError(f"{where}: prompt must be a non-empty string")
        return SourcePrompt(row=row, text=text, token_ids=None, gt_answer=gt_answer)
    ids = item["prompt_ids"]
    valid = isinstance(ids, list) and ids and all(_is_token_id(t) for t in ids)
    if not valid:
        raise RolloutSetupError(f"{where}: prompt_ids must be a non-empty list of ids >= 0")
    return SourcePrompt(row=row, text=None, token_ids=tuple(ids), gt_answer=gt_answer)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class PlannedBatch:
    """One batch of the schedule: its position and the prompt rows it makes."""

    step: int  # from 0, across epochs
    epoch: int  # from 0
    rows: tuple[int, ...]


def _mix(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7_919 + 1) & _SEED_MASK


def plan_batches(
    num_prompts: int, prompts_per_batch: int, *, seed: int, epochs: int = 1, steps: int = 0
) -> Iterator[PlannedBatch]:
    """The rollout's batches in order; epochs / steps of 0 mean no limit."""
    if num_prompts < 1 or prompts_per_batch < 1:
        raise ValueError("plan_batches needs at least one prompt and one prompt per batch")
    step = epoch = 0
    while epochs == 0 or epoch < epochs:
        order = list(range(num_prompts))
        random.Random(_mix(seed, epoch)).shuffle(order)
        for start in range(0, num_prompts, prompts_per_batch):
            if steps and step >= steps:
                return
            yield PlannedBatch(
                step=step, epoch=epoch, rows=tuple(order[start : start + prompts_per_batch])
            )
            step += 1
        epoch += 1


# ---- the request of one batch -----------------------------------------------------------------


def load_request_template(path: str | Path | None) -> pb.MakeExperienceRequest:
    """The --rollout-request template (protobuf JSON); an empty request when no file is given."""
    template = pb.MakeExperienceRequest()
    if path is None:
        return template
    try:
        json_format.Parse(Path(path).read_text(encoding="utf-8"), template)
    except (OSError, UnicodeDecodeError, json_format.ParseError) as exc:
        raise RolloutSetupError(f"rollout request template {path}: {exc}") from None
    has_prompts = template.token_ids.values or template.token_ids.lengths or template.texts.texts
    if has_prompts or template.gt_answers:
        raise RolloutSetupError(
            f"rollout request template {path}: holds prompts or gt_answers; they come from the "
            "prompt source"
        )
    if template.min_policy_version:
        # The loop stamps each batch with the version it was made by; waiting for a first
        # version is --wait-for-weights' job.
        raise RolloutSetupError(
            f"rollout request template {path}: min_policy_version is not used by the rollout; "
            "start the server with --wait-for-weights instead"
        )
    return template


def build_batch_request(
    template: pb.MakeExperienceRequest, source: PromptSource, planned: PlannedBatch, *, seed: int
) -> pb.MakeExperienceRequest:
    """The template plus one batch's prompts, answers, sampling seed and request id."""
    request = pb.MakeExperienceRequest()
    request.CopyFrom(template)
    prompts = [source.prompts[row] for row in planned.rows]
    if source.is_text:
        request.texts.texts.extend(p.text for p in prompts)  # keeps apply_chat_template
    else:
        request.token_ids.values.extend(t for p in prompts for t in p.token_ids)
        request.token_ids.lengths.extend(len(p.token_ids) for p in prompts)
    if source.has_gt_answers:
        request.gt_answers.extend(p.gt_answer or "" for p in prompts)
    base = template.sampling.seed if template.sampling.HasField("seed") else seed
    request.sampling.seed = _mix(base, planned.step)
    # One message per batch: its micro-batches would only be joined again.
    group = template.samples_per_prompt if template.HasField("samples_per_prompt") else 1
    request.batching.micro_batch_size = max(len(prompts) * group, 1)
    request.request_id = f"rollout-{planned.step}"
    return request


# ---- settings and progress --------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutSettings:
    """The rollout flags of ServerConfig."""

    prompts_per_batch: int = 8
    epochs: int = 1  # 0: no limit
    steps: int = 0  # 0: no limit
    seed: int = 0
    queue_batches: int = 4
    max_staleness: int | None = 1  # None: no bound

    @classmethod
    def from_config(cls, config: ServerConfig) -> RolloutSettings:
        return cls(
            prompts_per_batch=config.rollout_prompts_per_batch,
            epochs=config.rollout_epochs,
            steps=config.rollout_steps,
            seed=config.rollout_seed,
            queue_batches=config.rollout_queue_batches,
            max_staleness=config.max_staleness,
        )


@dataclass(frozen=True)
class RolloutStats:
    """A consistent snapshot of the rollout for Health and metrics."""

    finished: bool  # the schedule is done and nothing waits in the queue
    epoch: int  # epoch of the last batch the loop finished
    step: int  # batches the loop finished (made or failed)
    made: int
    delivered: int
    dropped_stale: int
    failed: int
    queued: int
    subscribers: int


@dataclass(frozen=True)
class MadeBatch:
    """A made batch waiting in the queue; batch_index is set when it is dealt."""

    response: pb.SubscribeResponse
    policy_version: int


# ---- dealing ----------------------------------------------------------------------------------


class Subscription:
    """One Subscribe call: iterate it for the responses to send; `cancel()` when the call ends."""

    def __init__(
        self, dealer: Dealer, name: str, max_batches: int, is_live: Callable[[], bool]
    ) -> None:
        self.name = name
        self.remaining: int | None = max_batches or None  # None: until the rollout ends
        self.received = 0
        self.gone = False
        self.is_live = is_live
        self._dealer = dealer

    def __iter__(self) -> Iterator[pb.SubscribeResponse]:
        try:
            while (response := self._dealer.take(self)) is not None:
                yield response
        finally:
            self._dealer.leave(self)

    def cancel(self) -> None:
        """The call is over (client gone, deadline): leave the ring now; idempotent."""
        self._dealer.leave(self)


class Dealer:
    """Made batches waiting in a bounded queue, dealt round-robin to a ring of subscribers."""

    def __init__(
        self, *, capacity: int, newest_version: Callable[[], int], max_staleness: int | None
    ) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[MadeBatch] = collections.deque()
        self._ring: list[Subscription] = []
        self._turn = 0  # index in _ring of the subscriber the next batch goes to
        self._capacity = capacity
        self._newest_version = newest_version
        self._max_staleness = max_staleness
        self._done = False  # the loop made its last batch
        self._closed = False
        self._delivered = 0
        self._dropped_stale = 0

    def join(self, name: str, max_batches: int, is_live: Callable[[], bool]) -> Subscription:
        subscription = Subscription(self, name, max_batches, is_live)
        with self._cond:
            self._ring.append(subscription)
            self._cond.notify_all()  # demand: the loop may start making
            _LOG.info("subscriber %s joined (%d connected)", name, len(self._ring))
        return subscription

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
            while True:
                if self._closed:
                    raise Unavailable("the server is shutting down; the rollout stopped")
                if sub.gone or sub.remaining == 0:
                    return None
                self._drop_stale_locked()
                if self._queue and self._ring[self._turn] is sub:
                    return self._deal_locked(sub)
                if self._done and not self._queue:
                    return None
                self._cond.wait()

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
        self._turn = (self._turn + 1) % len(self._ring)
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

    def wait_for_demand(self, can_make: Callable[[], bool]) -> bool:
        """Block until a subscriber is connected, the queue has room and `can_make()`.

        False when the dealer was closed.
        """
        with self._cond:
            while not self._closed:
                self._drop_stale_locked()
                if self._ring and len(self._queue) < self._capacity and can_make():
                    return True
                self._cond.wait()
        return False

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


# ---- the loop ---------------------------------------------------------------------------------


class ContinuousRollout:
    """The prompt source, the loop thread that makes batches, and the dealer that sends them."""

    def __init__(
        self,
        state: ServerState,
        source: PromptSource,
        template: pb.MakeExperienceRequest,
        settings: RolloutSettings,
    ) -> None:
        self.source = source
        self.template = template
        self.settings = settings
        self._state = state
        self.dealer = Dealer(
            capacity=settings.queue_batches,
            newest_version=lambda: state.policy_version("actor"),
            max_staleness=settings.max_staleness,
        )
        self._closed = threading.Event()  # also cancels the batch being made
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._made = self._failed = self._epoch = 0
        # Leaving WAITING_FOR_WEIGHTS (or entering it) changes whether the loop may make.
        state.on_phase_change(lambda phase: self.dealer.notify())

    @classmethod
    def from_config(cls, state: ServerState) -> ContinuousRollout | None:
        """The rollout the flags ask for (files read now); None without --rollout-prompts."""
        config = state.config
        if config.rollout_prompts is None:
            return None
        source = load_prompt_source(config.rollout_prompts)
        template = load_request_template(config.rollout_request)
        if template.texts.apply_chat_template and not source.is_text:
            raise RolloutSetupError(
                "rollout request template: apply_chat_template needs text prompts"
            )
        return cls(state, source, template, RolloutSettings.from_config(config))

    def start(self, runtime: Runtime) -> None:
        """Check the template on the loaded models (first batch), then start the loop thread."""
        first = next(self._plan())
        try:
            runtime.maker.decode(self._request(first))
        except RolloutError as exc:
            raise RolloutSetupError(f"rollout request template: {exc.message}") from None
        settings = self.settings
        _LOG.info(
            "continuous rollout: %d prompts, %d per batch, epochs %s, steps %s, queue %d, "
            "max staleness %s",
            len(self.source),
            settings.prompts_per_batch,
            settings.epochs or "unlimited",
            settings.steps or "unlimited",
            settings.queue_batches,
            "unlimited" if settings.max_staleness is None else settings.max_staleness,
        )
        self._thread = threading.Thread(
            target=self._run, args=(runtime,), name="rollserve-rollout", daemon=True
        )
        self._thread.start()

    def subscribe(self, name: str, max_batches: int, is_live: Callable[[], bool]) -> Subscription:
        return self.dealer.join(name, max_batches, is_live)

    def stats(self) -> RolloutStats:
        finished, delivered, dropped, queued, subscribers = self.dealer.counts()
        with self._lock:
            return RolloutStats(
                finished=finished,
                epoch=self._epoch,
                step=self._made + self._failed,
                made=self._made,
                delivered=delivered,
                dropped_stale=dropped,
                failed=self._failed,
                queued=queued,
                subscribers=subscribers,
            )

    def close(self, timeout_s: float = 0.0) -> None:
        """Stop making (the batch in progress is abandoned) and end every stream."""
        self._closed.set()
        self.dealer.close()
        if self._thread is not None and timeout_s > 0:
            self._thread.join(timeout_s)

    def _plan(self) -> Iterator[PlannedBatch]:
        s = self.settings
        return plan_batches(
            len(self.source), s.prompts_per_batch, seed=s.seed, epochs=s.epochs, steps=s.steps
        )

    def _request(self, planned: PlannedBatch) -> pb.MakeExperienceRequest:
        return build_batch_request(self.template, self.source, planned, seed=self.settings.seed)

    def _can_make(self) -> bool:
        return self._state.phase in _MAKING_PHASES

    def _run(self, runtime: Runtime) -> None:
        try:
            for planned in self._plan():
                made: bool | None = None
                while made is None:  # None: the phase changed before the engine got to it
                    if not self.dealer.wait_for_demand(self._can_make):
                        return
                    made = self._make_one(runtime, planned)
                if not made:
                    return
            _LOG.info("continuous rollout: the last batch is made")
        except Exception:  # a bug: say so loudly, and let the streams end
            _LOG.exception("the rollout loop failed; no more batches are made")
        finally:
            self.dealer.finish()

    def _make_one(self, runtime: Runtime, planned: PlannedBatch) -> bool | None:
        """Make one batch and queue it; False when the server is stopping, None when it stopped
        serving before the engine got to the batch (new weights failed their probe): retry."""
        try:
            spec = runtime.maker.decode(self._request(planned))
            made = self._on_engine(runtime, spec)
            if made is None:
                return None
            version, parts = made
        except Exception as exc:  # a bad prompt, a reward source down: skip this batch
            if self._closed.is_set():  # stopping: the engine refuses, the make was cancelled
                return False
            _LOG.error(
                "rollout batch %d (epoch %d) failed and was skipped: %s",
                planned.step,
                planned.epoch,
                exc,
                exc_info=not isinstance(exc, RolloutError),  # a traceback for bugs only
            )
            with self._lock:
                self._failed += 1
                self._epoch = planned.epoch
            return True
        if self._closed.is_set() or not parts:  # abandoned half-way by close()
            return False
        response = pb.SubscribeResponse(
            experience=experience_to_proto(self._joined(runtime, parts, planned)),
            epoch=planned.epoch,
            step=planned.step,
        )
        self.dealer.put(MadeBatch(response=response, policy_version=version))
        with self._lock:
            self._made += 1
            self._epoch = planned.epoch
        return True

    def _on_engine(
        self, runtime: Runtime, spec: ExperienceSpec
    ) -> tuple[int, list[Experience]] | None:
        """Run the maker on the engine thread; wait while the engine's queue is full. None when,
        on the engine, the server no longer makes experience (a probe failed meanwhile)."""

        def produce() -> tuple[int, list[Experience]] | None:
            if not self._can_make():  # checked on the engine: after any queued probe
                return None
            version = self._state.policy_version("actor")  # on the engine: no swap races it
            batches = runtime.maker.iter_experience(
                spec, policy_version=version, cancelled=self._closed
            )
            return version, list(batches)

        delay_s = 0.05
        while True:
            try:
                future = runtime.engine.submit(produce)
                break
            except ResourceExhausted:  # RPC work fills the engine's queue: wait for a slot
                if self._closed.wait(delay_s):
                    raise Unavailable("the rollout stopped") from None
                delay_s = min(delay_s * 2, 1.0)
        return future.result()

    @staticmethod
    def _joined(runtime: Runtime, parts: list[Experience], planned: PlannedBatch) -> Experience:
        """One Experience whose prompt_index holds the prompt ids of the source."""
        if len(parts) == 1:
            experience = parts[0]
        else:
            experience = concat_experiences(parts, pad_token_id=runtime.maker.pad_token_id)
        rows = torch.tensor(planned.rows, dtype=torch.int64)  # request index -> source row
        return dataclasses.replace(experience, prompt_index=rows[experience.prompt_index])
