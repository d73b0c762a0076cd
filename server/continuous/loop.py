"""The rollout loop: one thread makes one batch at a time on the engine and hands it to the dealer.

One batch at a time on the engine, so weight updates (engine jobs too) swap between batches and
every batch is made by one policy version, read on the engine thread. The loop makes a batch only
while the dealer has demand and room (dealer.py: back-pressure) and the server serves (not while
it waits for weights). A batch that fails (a prompt too long for the context, a reward source
error) is logged, counted as failed and skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ...client.protocol.errors import ResourceExhausted, RolloutError, Unavailable
from ...client.protocol.experience import Experience, concat_experiences, experience_to_proto
from ...client.protocol.reward_moments import RunningRewardMoments
from ...v1 import rollout_pb2 as pb
from ..config import ServerConfig
from ..engine.runtime import Runtime
from ..experience.request import ExperienceSpec
from ..state import Phase, ServerState
from .batch_request import build_batch_request, load_request_template
from .dealer import Dealer, MadeBatch, Subscription
from .source import PlannedBatch, PromptSource, RolloutSetupError, load_prompt_source, plan_batches

__all__ = ["ContinuousRollout", "RolloutSettings", "RolloutStats"]

_LOG = logging.getLogger(__name__)
_MAKING_PHASES = (Phase.SERVING, Phase.DRAINING)  # the phases MakeExperience serves in


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
        # LightRFT's running reward moments (AlgorithmOptions.reward_running_norm) thread from
        # batch to batch here, as a trainer threads them from request to request; the loop
        # thread alone reads and writes them, in the order the batches are made.
        self._reward_moments = (
            template.algorithm.reward_moments
            if template.algorithm.reward_running_norm not in ("", "off")
            else None
        )
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

    def subscribe(
        self,
        name: str,
        max_batches: int,
        is_live: Callable[[], bool],
        *,
        window: int | None = None,
    ) -> Subscription:
        """A new subscriber; `window` None: no acknowledgements (see dealer.py)."""
        return self.dealer.join(name, max_batches, is_live, window)

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
        request = build_batch_request(self.template, self.source, planned, seed=self.settings.seed)
        if self._reward_moments is not None:
            request.algorithm.reward_moments.CopyFrom(self._reward_moments)
        return request

    def _carry_reward_moments(self, parts: list[Experience]) -> None:
        """The moments after this batch's last micro-batch start the next batch."""
        if self._reward_moments is not None:
            self._reward_moments = RunningRewardMoments.from_experience(parts[-1]).to_proto()

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
        self._carry_reward_moments(parts)
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
