"""The experience maker: prompts in, Experience micro-batches out (ColossalChat's
NaiveExperienceMaker, LightRFT's make_experience_list).

A request runs as: per generation batch of whole groups, generate -> score -> decode ->
reward (steps.py; on a GPU the response texts are decoded on a thread while the device
scores) -> shape rewards, KL and advantages (algorithms.shape_experience) -> cut into
micro-batches of whole groups, each trimmed to its own tight width, on the CPU
(micro_batches.py). Shaping needs only a group at a time, so micro-batches stream as each
generation batch is done, except when the algorithm needs the whole request
(AlgorithmConfig.shapes_whole_request: whitening, or LightRFT's per-experience steps, whose
experiences are the micro-batches) (batches.merge_batches).

Where each Experience field is computed:

  sequences, attention_mask              steps.generate_rows (generation.generate)
  info response_length, total_length,    steps.generate_rows; copied by batches.to_experience
    truncated
  action_log_probs, action_entropy       steps.score_rows: the actor (scoring.action_log_probs)
  rollout_log_probs                      steps.generate_rows: recorded while sampling; copied
                                           by batches.to_experience
  base_action_log_probs                  steps.score_rows: the reference
  values                                 steps.score_rows: the critic (scoring.critic_values)
  response_texts                         steps.decode_responses
  info reward/<source>                   steps.recipe_rewards (scoring.reward_scores, rewards.py)
  reward, kl, advantages, returns,       steps.shape_batch (algorithms.shape_experience: the
    action_mask, other info                preset's KL, shaping, estimator, whitening, filters)
  policy_version, prompt_index           batches.to_experience
  info time/<phase>_s,                   maker.make_batch and the steps it calls (timing.py:
    time/generated_tokens_per_s            PhaseClock); time/shape_s: steps.shape_batch

The gRPC servicer and the in-process API run this same code, so both give identical tensors
for the same seed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch

from ...client.protocol.errors import FailedPrecondition
from ...client.protocol.experience import Experience, concat_experiences
from ...client.protocol.requests import Prompts, build_make_experience_request
from ...v1 import rollout_pb2 as pb
from ..generation import GenerationSettings, adopt_settings, engine_for
from ..models import ModelSet
from .batches import ScoredBatch, merge_batches
from .micro_batches import MicroBatcher
from .request import ExperienceSpec, RequestDefaults, decode_experience_request
from .rewards import RewardRegistry
from .scoring import action_log_probs, critic_values, reward_scores
from .steps import (
    batch_seed,
    decode_responses,
    generate_rows,
    generation_batches,
    recipe_rewards,
    response_ids,
    score_rows,
    shape_batch,
)
from .timing import PhaseClock, per_row_times

__all__ = ["WARM_UP_PROMPT_TOKENS", "NaiveExperienceMaker"]

# Prompt tokens of the start-up warm-up's dummy rows (a typical RL prompt length).
WARM_UP_PROMPT_TOKENS = 128

_log = logging.getLogger("rollserve.experience")


class _Background:
    """fn(*args) on a thread of its own; result() waits for it and returns its value or raises
    its exception."""

    def __init__(self, fn: Callable[..., object], *args: object) -> None:
        self._value: object = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True,
                                        name="rollserve-decode")  # fmt: skip
        self._thread.start()

    def _run(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            self._error = error

    def result(self) -> object:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class NaiveExperienceMaker:
    """Makes experience with the models of one ModelSet on their device; the in-process API has
    the shape of ColossalChat's experience makers (`make_experience`)."""

    def __init__(
        self,
        models: ModelSet,
        rewards: RewardRegistry,
        defaults: RequestDefaults,
        *,
        policy_version: Callable[[], int] = lambda: 0,
        generation: GenerationSettings | None = None,
    ) -> None:
        # policy_version: reads the actor's version where it is held (ServerState); a maker
        # outside a server serves version 0. generation: the server's path and KV budget
        # (--generation-path, --kv-cache-tokens, --gpu-memory-utilization); None: the defaults.
        self.models = models
        self.generation = generation or GenerationSettings()
        for model in models.loaded():  # scoring takes the path generation takes (registry.py)
            adopt_settings(model.module, self.generation)
        self.rewards = rewards
        self.defaults = defaults
        self.tokenizer_lock = threading.Lock()
        self._policy_version = policy_version
        # The response texts are host work (the tokenizer, ~0.06 s for 512 rows on the H100's
        # host): on a GPU they are decoded on a thread of their own while the device scores the
        # rows. On the CPU scoring needs the cores itself, so they are decoded after it.
        self.decode_in_background = models.device.type == "cuda"

    @property
    def pad_token_id(self) -> int:
        return int(self.models.tokenizer.pad_token_id)

    def warm_up(self) -> float | None:
        """Build the actor's generation engine for the server's default request before the
        server reports SERVING, rather than in the first request: its KV cache, and the decode
        step of every batch bucket up to generate_batch_size at every attention width of the
        default layout, compiled and captured as CUDA graphs (Engine.warm_up, bounded by its
        WARM_UP_BUDGET_S); then one scoring forward batch of each loaded model on the same rows.
        Returns its seconds, None on the hf path (nothing to build).

        The shape: the server's defaults (its sampling settings, as decoding a request without
        options resolves them), WARM_UP_PROMPT_TOKENS prompt tokens (fewer when the context or
        the KV budget is smaller). Requests of the same layout width and sampling structure
        (any temperature, top-p, min_new_tokens) replay what it built; another layout only
        captures its graphs again (the compiled code serves every batch size).
        """
        actor = self.models.actor.module
        engine = engine_for(actor, self.generation)
        if engine is None:
            return None
        defaults = self.defaults
        request = build_make_experience_request(
            [[1]], rewards=["exact_match"], gt_answers=[""], max_new_tokens=defaults.max_new_tokens
        )
        sampling = self.decode(request).sampling
        context = self.models.max_context_tokens
        width = max(1, min(WARM_UP_PROMPT_TOKENS, context - sampling.max_new_tokens))
        if not engine.fits(width, sampling.max_new_tokens):
            return None  # such requests take the Hugging Face path
        start = time.perf_counter()
        engine.warm_up(
            sampling, defaults.generate_batch_size, width, pad_token_id=self.pad_token_id
        )
        self._warm_up_scoring(width + sampling.max_new_tokens, sampling.max_new_tokens)
        # The figures the memory target is read from, once at start (off CUDA: the sizes only).
        figures = engine.memory().as_info()
        _log.info(
            "engine memory after the warm-up (GiB; graphs: a count): %s",
            ", ".join(f"{name} {value:.2f}" for name, value in figures.items()),
        )
        return time.perf_counter() - start

    def _warm_up_scoring(self, width: int, actions: int) -> None:
        """One forward batch of dummy rows through each loaded model's scoring."""
        models, rows = self.models, self.defaults.forward_batch_size
        sequences = torch.ones((rows, width), dtype=torch.long, device=models.device)
        mask = torch.ones_like(sequences)
        for model in (models.actor, models.reference):
            if model is not None:
                action_log_probs(model.module, sequences, mask, actions, forward_batch_size=rows)
        if models.critic is not None:
            critic_values(models.critic.module, sequences, mask, actions, forward_batch_size=rows)
        if models.reward is not None:
            reward_scores(models.reward.module, sequences, mask, forward_batch_size=rows)
        if models.device.type == "cuda":
            torch.cuda.synchronize(models.device)

    def decode(self, request: pb.MakeExperienceRequest) -> ExperienceSpec:
        """Validate a MakeExperienceRequest against this maker's models and limits."""
        return decode_experience_request(
            request,
            models=self.models,
            rewards=self.rewards,
            defaults=self.defaults,
            tokenizer_lock=self.tokenizer_lock,
        )

    def make_experience(self, prompts: Prompts, **options: object) -> Experience:
        """All rows of one request as one Experience (options: build_make_experience_request)."""
        spec = self.decode(build_make_experience_request(prompts, **options))
        batches = list(self.iter_experience(spec, policy_version=self._policy_version()))
        return concat_experiences(batches, pad_token_id=self.pad_token_id)

    def iter_experience(
        self,
        spec: ExperienceSpec,
        *,
        policy_version: int,
        cancelled: threading.Event | None = None,
    ) -> Iterator[Experience]:
        """Micro-batches of whole groups, in row order, on the CPU, made by `policy_version`
        (read on the engine thread, so no swap races it): FAILED_PRECONDITION below the
        request's min_policy_version."""
        if spec.min_policy_version > policy_version:
            raise FailedPrecondition(
                f"min_policy_version: {spec.min_policy_version} requested, the actor is at "
                f"version {policy_version}"
            )
        whole_request = spec.algorithm.shapes_whole_request
        held: list[ScoredBatch] = []  # whitening statistics span every row of the request
        micro_batches = MicroBatcher(spec.micro_batch_rows, self.pad_token_id)
        for index, rows in enumerate(generation_batches(spec)):
            if cancelled is not None and cancelled.is_set():
                return
            scored = self.make_batch(spec, rows, batch_seed(spec.seed, index))
            if whole_request:
                held.append(scored)
                continue
            yield from micro_batches.add(shape_batch(spec, scored, policy_version))
        if held:
            whole = merge_batches(held, self.pad_token_id)
            yield from micro_batches.add(shape_batch(spec, whole, policy_version))
        yield from micro_batches.flush()

    def make_batch(self, spec: ExperienceSpec, rows: list[int], seed: int) -> ScoredBatch:
        """One generation batch of whole groups (rows: the prompt index of each row), generated,
        scored and rewarded; not shaped yet."""
        models, lock = self.models, self.tokenizer_lock
        clock = PhaseClock(models.device)
        with clock.phase("generate"):
            generation = generate_rows(models, spec, rows, seed, self.generation)
        responses = response_ids(generation)
        decoding = None
        if self.decode_in_background:
            decoding = _Background(decode_responses, models, responses, lock)
        scores = score_rows(models, spec, generation, clock)
        with clock.phase("decode"):  # with a background decode: the wait for what is left of it
            texts = (
                decode_responses(models, responses, lock) if decoding is None else decoding.result()
            )
        rewards, reward_info = recipe_rewards(
            models, self.rewards, spec, rows, generation, texts, lock, clock
        )
        tokens = int(generation.response_lengths.sum())
        return ScoredBatch(
            generation=generation,
            prompt_index=torch.tensor(rows, dtype=torch.int64),
            actor_log_probs=scores.actor_log_probs,
            reference_log_probs=scores.reference_log_probs,
            values=scores.values,
            entropy=scores.entropy,
            rewards=rewards,
            reward_info=reward_info,
            texts=texts,
            times=per_row_times(clock.seconds, len(rows), tokens),
        )
