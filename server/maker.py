"""The experience maker: prompts in, Experience micro-batches out (ColossalChat's
NaiveExperienceMaker, LightRFT's make_experience_list).

One request runs as: expand prompts into groups of n samples -> per generation batch (whole
groups): generate with the actor, score with actor / reference / critic (teacher forced), reward
sources -> shape rewards, KL and advantages (algorithms.shape_experience) -> cut into
micro-batches of whole groups, each trimmed to its own tight width, on the CPU.

Shaping needs only a group at a time, so micro-batches stream as each generation batch is done,
except when advantages are whitened, which takes statistics over the whole request. Every
micro-batch has exactly micro_batch_rows rows (the last may have fewer): rows left over at the
end of one generation batch wait for the next one (_RowBuffer), so the stream carries exactly
ExperienceSpec.num_micro_batches messages whatever the generation batch size.

The gRPC servicer and the in-process API run this same code, so both give identical tensors
for the same seed.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from rollserve.client.errors import FailedPrecondition
from rollserve.client.experience import (
    EXPERIENCE_ACTION_FIELDS,
    EXPERIENCE_SEQUENCE_FIELDS,
    EXPERIENCE_TENSOR_FIELDS,
    Experience,
    concat_experiences,
)
from rollserve.client.requests import Prompts, build_make_experience_request
from rollserve.server.algorithms import ShapedExperience, shape_experience
from rollserve.server.experience_request import (
    ExperienceSpec,
    RequestDefaults,
    decode_experience_request,
)
from rollserve.server.generation import GenerationOutput, generate
from rollserve.server.models import ModelSet
from rollserve.server.rewards import REWARD_MODEL_SOURCE, RewardRegistry
from rollserve.server.scoring import action_log_probs, critic_values, reward_scores

__all__ = ["ExperienceMaker", "NaiveExperienceMaker", "batch_seed"]

_SEED_MASK = (1 << 63) - 1


def batch_seed(seed: int, batch_index: int) -> int:
    """The generator seed of one generation batch: distinct per batch, fixed per request seed."""
    return (seed * 1_000_003 + batch_index * 7_919) & _SEED_MASK


@dataclass(frozen=True)
class ScoredBatch:
    """Generated and scored rows, before reward shaping. B rows, S = P + A."""

    generation: GenerationOutput
    prompt_index: torch.Tensor  # (B,) int64
    actor_log_probs: torch.Tensor  # (B, A) teacher-forced
    reference_log_probs: torch.Tensor | None  # (B, A)
    values: torch.Tensor | None  # (B, A)
    entropy: torch.Tensor | None  # (B, A)
    rewards: torch.Tensor  # (B,) weighted sum of the recipe
    reward_info: dict[str, torch.Tensor]  # "reward/<source>": (B,) raw values
    texts: tuple[str, ...]  # decoded responses


class ExperienceMaker(abc.ABC):
    """In-process API with the shape of ColossalChat's experience makers."""

    policy_version: int = 0

    @abc.abstractmethod
    def decode(self, request) -> ExperienceSpec:
        """Validate a MakeExperienceRequest against this maker's models."""

    @abc.abstractmethod
    def iter_experience(
        self,
        spec: ExperienceSpec,
        *,
        policy_version: int,
        cancelled: threading.Event | None = None,
    ) -> Iterator[Experience]:
        """Micro-batches of whole groups, in row order, on the CPU."""

    def make_experience(self, prompts: Prompts, **options: object) -> Experience:
        """All rows of one request as one Experience (options: build_make_experience_request)."""
        spec = self.decode(build_make_experience_request(prompts, **options))
        if spec.min_policy_version > self.policy_version:  # the same refusal as the RPC's
            raise FailedPrecondition(
                f"min_policy_version: {spec.min_policy_version} requested, the actor is at "
                f"version {self.policy_version}"
            )
        batches = list(self.iter_experience(spec, policy_version=self.policy_version))
        return concat_experiences(batches, pad_token_id=self.pad_token_id)

    @property
    @abc.abstractmethod
    def pad_token_id(self) -> int: ...


class NaiveExperienceMaker(ExperienceMaker):
    """Makes experience with the models of one ModelSet on their device."""

    def __init__(
        self, models: ModelSet, rewards: RewardRegistry, defaults: RequestDefaults
    ) -> None:
        self.models = models
        self.rewards = rewards
        self.defaults = defaults
        self.tokenizer_lock = threading.Lock()

    @property
    def pad_token_id(self) -> int:
        return int(self.models.tokenizer.pad_token_id)

    def decode(self, request) -> ExperienceSpec:
        return decode_experience_request(
            request,
            models=self.models,
            rewards=self.rewards,
            defaults=self.defaults,
            tokenizer_lock=self.tokenizer_lock,
        )

    def iter_experience(
        self,
        spec: ExperienceSpec,
        *,
        policy_version: int,
        cancelled: threading.Event | None = None,
    ) -> Iterator[Experience]:
        whole_request = spec.algorithm.effective_whitening != "none"
        pending: list[ScoredBatch] = []
        buffer = _RowBuffer(spec.micro_batch_rows, self.pad_token_id)
        for index, rows in enumerate(_chunks(_row_prompts(spec), spec.generate_batch_rows)):
            if cancelled is not None and cancelled.is_set():
                return
            scored = self._generate_and_score(spec, rows, batch_seed(spec.seed, index))
            if whole_request:  # whitening statistics span every row of the request
                pending.append(scored)
                continue
            yield from buffer.add(self._shaped(spec, scored, policy_version))
        if pending:
            merged = _merge(pending, self.pad_token_id)
            yield from buffer.add(self._shaped(spec, merged, policy_version))
        yield from buffer.flush()

    # ---- one generation batch ---------------------------------------------------------------

    def _generate_and_score(self, spec: ExperienceSpec, rows: list[int], seed: int) -> ScoredBatch:
        models = self.models
        generator = torch.Generator(device=models.device).manual_seed(seed)
        generation = generate(
            models.actor.module,
            [spec.prompts[p] for p in rows],
            spec.sampling,
            pad_token_id=self.pad_token_id,
            generator=generator,
        )
        seqs, mask = generation.sequences, generation.attention_mask
        actions = generation.action_mask.shape[1]
        score = dict(forward_batch_size=spec.forward_batch_rows)
        temperature = spec.sampling.temperature
        use_temperature = spec.sampling.logprobs_use_temperature and temperature > 0
        cfg = spec.algorithm
        logp, entropy = action_log_probs(
            models.actor.module,
            seqs,
            mask,
            actions,
            temperature=temperature if use_temperature else None,
            with_entropy=spec.return_entropy or cfg.needs_entropy,
            **score,
        )
        reference = None
        if models.reference is not None and (cfg.needs_reference or cfg.kl_mode == "loss"):
            reference, _ = action_log_probs(
                models.reference.module,
                seqs,
                mask,
                actions,
                temperature=temperature if use_temperature else None,
                **score,
            )
        values = None
        if cfg.needs_critic:
            values = critic_values(models.critic.module, seqs, mask, actions, **score)
        texts = self._decode_responses(generation)
        rewards, reward_info = self._rewards(spec, rows, generation, texts)
        return ScoredBatch(
            generation=generation,
            prompt_index=torch.tensor(rows, dtype=torch.int64),
            actor_log_probs=logp,
            reference_log_probs=reference,
            values=values,
            entropy=entropy,
            rewards=rewards,
            reward_info=reward_info,
            texts=texts,
        )

    def _decode_responses(self, generation: GenerationOutput) -> tuple[str, ...]:
        width = generation.prompt_width
        lengths = generation.response_lengths.tolist()
        rows = generation.sequences[:, width:].tolist()
        with self.tokenizer_lock:
            return tuple(
                self.models.tokenizer.decode(ids[:n], skip_special_tokens=True)
                for ids, n in zip(rows, lengths, strict=True)
            )

    def _rewards(
        self,
        spec: ExperienceSpec,
        rows: list[int],
        generation: GenerationOutput,
        texts: tuple[str, ...],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        prompts: list[str] = []
        if any(source != REWARD_MODEL_SOURCE for source, _ in spec.rewards):
            with self.tokenizer_lock:
                decoded = {p: self.models.tokenizer.decode(spec.prompts[p]) for p in set(rows)}
            prompts = [decoded[p] for p in rows]
        total = torch.zeros(len(rows), dtype=torch.float32)
        info: dict[str, torch.Tensor] = {}
        for source, weight in spec.rewards:
            if source == REWARD_MODEL_SOURCE:
                raw = reward_scores(
                    self.models.reward.module,
                    generation.sequences,
                    generation.attention_mask,
                    forward_batch_size=spec.forward_batch_rows,
                ).cpu()
            else:
                gts = [spec.gt_answers[p] for p in rows]
                scores = self.rewards.score(source, prompts, list(texts), gts)
                raw = torch.tensor(scores, dtype=torch.float32)
            info[f"reward/{source}"] = raw
            total += weight * raw
        return total, info

    # ---- shaping and micro-batches ----------------------------------------------------------

    def _shaped(self, spec: ExperienceSpec, scored: ScoredBatch, policy_version: int) -> Experience:
        """Shape the rewards, KL and advantages of scored rows; the rows as one Experience."""
        generation = scored.generation
        device = generation.action_log_probs.device
        shaped = shape_experience(
            spec.algorithm,
            action_log_probs=scored.actor_log_probs,
            base_action_log_probs=scored.reference_log_probs,
            action_mask=generation.action_mask,
            values=scored.values,
            rewards=scored.rewards.to(device),
            group_size=spec.samples_per_prompt,
            max_new_tokens=spec.sampling.max_new_tokens,
            entropy=scored.entropy,
        )
        return _to_experience(spec, scored, shaped, policy_version)


class _RowBuffer:
    """Rows made but not streamed yet; hands them out as micro-batches of exactly `rows` rows.

    Rows arrive a generation batch at a time, in the generation batch's layout. A micro-batch
    that spans two generation batches is joined with concat_experiences (wire layout); each one
    is trimmed to its own tight width. `rows` is a multiple of the group size and so is every
    generation batch, so a group is never split.
    """

    def __init__(self, rows: int, pad_token_id: int) -> None:
        self.rows = rows
        self.pad_token_id = pad_token_id
        self.parts: list[Experience] = []
        self.count = 0

    def add(self, experience: Experience) -> Iterator[Experience]:
        self.parts.append(experience)
        self.count += experience.num_rows
        while self.count >= self.rows:
            yield self._take(self.rows)

    def flush(self) -> Iterator[Experience]:
        if self.count:
            yield self._take(self.count)

    def _take(self, rows: int) -> Experience:
        taken: list[Experience] = []
        while rows:
            part = self.parts[0]
            if part.num_rows <= rows:
                taken.append(_tight(self.parts.pop(0)))
                rows -= part.num_rows
                self.count -= part.num_rows
                continue
            taken.append(_tight(_select_rows(part, slice(0, rows))))
            self.parts[0] = _select_rows(part, slice(rows, None))
            self.count -= rows
            rows = 0
        if len(taken) == 1:
            return taken[0]
        return concat_experiences(taken, pad_token_id=self.pad_token_id)


def _row_prompts(spec: ExperienceSpec) -> list[int]:
    """The prompt index of every row: each prompt repeated n times, consecutively (a group)."""
    return [p for p in range(len(spec.prompts)) for _ in range(spec.samples_per_prompt)]


def _chunks(items: Sequence[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def _to_experience(
    spec: ExperienceSpec, scored: ScoredBatch, shaped: ShapedExperience, version: int
) -> Experience:
    """The whole generation batch as an Experience on the CPU (float32, bool masks)."""
    generation = scored.generation
    rows = generation.sequences.shape[0]
    info = {key: _cpu(value) for key, value in shaped.info.items()}
    info.update(scored.reward_info)
    info["response_length"] = _cpu(generation.response_lengths).to(torch.int64)
    info["total_length"] = _cpu(generation.attention_mask).sum(-1).to(torch.int64)
    info["truncated"] = _cpu(generation.truncated).to(torch.bool)
    return Experience(
        sequences=_cpu(generation.sequences),
        attention_mask=_cpu(generation.attention_mask).bool(),
        action_mask=_cpu(shaped.action_mask).bool(),
        action_log_probs=_cpu(shaped.action_log_probs).float(),
        base_action_log_probs=_float(_cpu(shaped.base_action_log_probs)),
        values=_float(_cpu(scored.values)),
        reward=_cpu(shaped.reward).float(),
        kl=_cpu(shaped.kl).float(),
        advantages=_cpu(shaped.advantages).float(),
        returns=_cpu(shaped.returns).float(),
        action_entropy=_float(_cpu(scored.entropy)) if spec.return_entropy else None,
        info=info,
        policy_version=torch.full((rows,), version, dtype=torch.int64),
        prompt_index=scored.prompt_index.clone(),
        response_texts=scored.texts if spec.return_texts else None,
    )


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu")


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _select_rows(e: Experience, rows: slice) -> Experience:
    """Rows of an Experience (views)."""
    changes: dict[str, object] = {}
    for name in EXPERIENCE_TENSOR_FIELDS:
        value = getattr(e, name)
        changes[name] = None if value is None else value[rows]
    changes["info"] = {key: value[rows] for key, value in e.info.items()}
    changes["response_texts"] = None if e.response_texts is None else e.response_texts[rows]
    return replace(e, **changes)


def _tight(e: Experience) -> Experience:
    """Trim the columns no row uses: the common left pad of the prompts and the common right
    pad of the responses (read from the attention mask, which is true on every real token)."""
    mask = e.attention_mask  # (B, S)
    width = e.prompt_width
    width_p = int(mask[:, :width].sum(-1).max())  # longest prompt
    width_a = int(mask[:, width:].sum(-1).max())  # longest response (>= 1 token per row)
    # Token columns keep the longest prompt and response; action columns the longest response.
    # Per-row fields (reward, indices) have no columns to trim.
    columns = dict.fromkeys(EXPERIENCE_SEQUENCE_FIELDS, slice(width - width_p, width + width_a))
    columns.update(dict.fromkeys(EXPERIENCE_ACTION_FIELDS, slice(0, width_a)))
    changes: dict[str, object] = {}
    for name, kept in columns.items():
        value = getattr(e, name)
        changes[name] = None if value is None else value[:, kept].contiguous()
    actions = e.num_actions
    changes["info"] = {
        key: value[:, :width_a].contiguous()
        if value.ndim >= 2 and value.shape[1] == actions
        else value.contiguous()
        for key, value in e.info.items()
    }
    return replace(e, **changes)


def _merge(batches: list[ScoredBatch], pad_token_id: int) -> ScoredBatch:
    """Join generation batches into one, padded to a common layout (prompt left, response
    right)."""
    if len(batches) == 1:
        return batches[0]
    width_p = max(b.generation.prompt_width for b in batches)
    width_a = max(b.generation.action_mask.shape[1] for b in batches)

    def actions(t: torch.Tensor | None, a: int, value: float = 0) -> torch.Tensor | None:
        return None if t is None else torch.nn.functional.pad(t, (0, width_a - a), value=value)

    def cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if parts[0] is None else torch.cat(parts)

    gens, parts = [], {k: [] for k in ("logp", "ref", "values", "entropy")}
    for b in batches:
        g, a = b.generation, b.generation.action_mask.shape[1]
        pad = (width_p - g.prompt_width, width_a - a)
        gens.append(
            replace(
                g,
                sequences=torch.nn.functional.pad(g.sequences, pad, value=pad_token_id),
                attention_mask=torch.nn.functional.pad(g.attention_mask, pad, value=False),
                action_mask=actions(g.action_mask, a, False),
                action_log_probs=actions(g.action_log_probs, a),
                prompt_width=width_p,
            )
        )
        parts["logp"].append(actions(b.actor_log_probs, a))
        parts["ref"].append(actions(b.reference_log_probs, a))
        parts["values"].append(actions(b.values, a))
        parts["entropy"].append(actions(b.entropy, a))
    generation = replace(
        gens[0],
        **{
            name: torch.cat([getattr(g, name) for g in gens])
            for name in (
                "sequences",
                "attention_mask",
                "action_mask",
                "action_log_probs",
                "response_lengths",
                "truncated",
            )
        },
    )
    return ScoredBatch(
        generation=generation,
        prompt_index=torch.cat([b.prompt_index for b in batches]),
        actor_log_probs=cat(parts["logp"]),
        reference_log_probs=cat(parts["ref"]),
        values=cat(parts["values"]),
        entropy=cat(parts["entropy"]),
        rewards=torch.cat([b.rewards for b in batches]),
        reward_info={
            k: torch.cat([b.reward_info[k] for b in batches]) for k in batches[0].reward_info
        },
        texts=tuple(t for b in batches for t in b.texts),
    )
