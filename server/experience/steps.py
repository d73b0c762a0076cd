"""The steps of one generation batch, in order: generate -> score -> decode -> reward -> shape.

Each step is a plain function of the request's ExperienceSpec and the models; the docstring of
each names the Experience fields it computes. maker.py chains them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ...client.protocol.experience import Experience
from ..algorithms import process_sequences, shape_experience
from ..generation import GenerationSettings
from ..models import ModelSet
from .batches import ScoredBatch, to_experience
from .generation import GenerationOutput, generate
from .request import ExperienceSpec
from .rewards import REWARD_MODEL_SOURCE, RewardRegistry
from .scoring import action_log_probs, critic_values, reward_scores
from .timing import PhaseClock, phase_key

__all__ = [
    "ResponseIds",
    "Scores",
    "batch_seed",
    "decode_responses",
    "generate_rows",
    "generation_batches",
    "recipe_rewards",
    "response_ids",
    "score_rows",
    "shape_batch",
]

_SEED_MASK = (1 << 63) - 1


def generation_batches(spec: ExperienceSpec) -> Iterator[list[int]]:
    """The prompt index of every row, cut into generation batches of whole groups.

    Each prompt is repeated samples_per_prompt times, consecutively (a group);
    generate_batch_rows is a multiple of the group size.
    """
    rows = [p for p in range(len(spec.prompts)) for _ in range(spec.samples_per_prompt)]
    for start in range(0, len(rows), spec.generate_batch_rows):
        yield rows[start : start + spec.generate_batch_rows]


def batch_seed(seed: int, batch_index: int) -> int:
    """The generator seed of one generation batch: distinct per batch, fixed per request seed."""
    return (seed * 1_000_003 + batch_index * 7_919) & _SEED_MASK


def generate_rows(
    models: ModelSet,
    spec: ExperienceSpec,
    rows: list[int],
    seed: int,
    settings: GenerationSettings | None = None,
) -> GenerationOutput:
    """Sample one response per row with the actor, on the path `settings` pick (the server's
    --generation-path and KV budget; None: auto).

    Fields: sequences, attention_mask, the action mask before filters, rollout_log_probs
    (the behaviour log-probs), info response_length, total_length and truncated. Rows of one
    group share their prompt's prefill. Under action_mask_rule "process_sequences" the masks
    (and the EOS they imply) are LightRFT's, derived from the tokens before anything scores them.
    """
    pad_token_id = int(models.tokenizer.pad_token_id)
    output = generate(
        models.actor.module,
        [spec.prompts[p] for p in rows],
        spec.sampling,
        pad_token_id=pad_token_id,
        generator=torch.Generator(device=models.device).manual_seed(seed),
        path=settings,
    )
    if spec.algorithm.action_mask_rule != "process_sequences":
        return output
    derived = process_sequences(
        output.sequences,
        output.prompt_width,
        int(models.tokenizer.eos_token_id),  # present: decode_experience_request checked it
        pad_token_id,
        eos_over_last_token=spec.algorithm.eos_over_last_token,
    )
    return replace(output, **vars(derived))


@dataclass(frozen=True)
class Scores:
    """Teacher-forced scores of generated rows, (B, A) each."""

    actor_log_probs: torch.Tensor
    entropy: torch.Tensor | None  # when returned or the algorithm filters on it
    reference_log_probs: torch.Tensor | None  # when the algorithm needs a KL
    values: torch.Tensor | None  # when the estimator needs a critic


def score_rows(
    models: ModelSet,
    spec: ExperienceSpec,
    generation: GenerationOutput,
    clock: PhaseClock | None = None,
) -> Scores:
    """Re-score the generated rows with actor, reference and critic (teacher forced).

    Fields: action_log_probs and action_entropy (actor), base_action_log_probs (reference),
    values (critic); the log-probs divide the logits by the temperature only under
    logprobs_use_temperature (never for greedy decoding). `clock` times each model's scoring.
    """
    clock = clock or PhaseClock(models.device)
    cfg, sampling = spec.algorithm, spec.sampling
    seqs, mask = generation.sequences, generation.attention_mask
    actions = generation.action_mask.shape[1]
    use_temperature = sampling.logprobs_use_temperature and sampling.temperature > 0
    log_probs = dict(
        forward_batch_size=spec.forward_batch_rows,
        temperature=sampling.temperature if use_temperature else None,
    )
    with clock.phase("score_actor"):
        actor, entropy = action_log_probs(
            models.actor.module,
            seqs,
            mask,
            actions,
            with_entropy=spec.return_entropy or cfg.needs_entropy,
            **log_probs,
        )
    reference = None
    if models.reference is not None and (cfg.needs_reference or cfg.kl_mode == "loss"):
        with clock.phase("score_reference"):
            reference, _ = action_log_probs(
                models.reference.module, seqs, mask, actions, **log_probs
            )
    values = None
    if cfg.needs_critic:
        with clock.phase("score_critic"):
            values = critic_values(
                models.critic.module,
                seqs,
                mask,
                actions,
                forward_batch_size=spec.forward_batch_rows,
            )
    return Scores(actor, entropy, reference, values)


@dataclass(frozen=True)
class ResponseIds:
    """Each row's response token ids, on the host: what decode_responses reads."""

    rows: list[list[int]]  # the response columns of each row
    lengths: list[int]  # each row's valid response tokens


def response_ids(generation: GenerationOutput) -> ResponseIds:
    """The generated rows' response ids copied to the host, on the calling (engine) thread: a
    copy from another thread would wait behind whatever the engine queued on the device since."""
    width = generation.prompt_width
    return ResponseIds(
        generation.sequences[:, width:].tolist(), generation.response_lengths.tolist()
    )


def decode_responses(
    models: ModelSet, responses: ResponseIds, tokenizer_lock: threading.Lock
) -> tuple[str, ...]:
    """The text of each row's valid response tokens. Field: response_texts."""
    with tokenizer_lock:
        return tuple(
            models.tokenizer.decode(ids[:n], skip_special_tokens=True)
            for ids, n in zip(responses.rows, responses.lengths, strict=True)
        )


def recipe_rewards(
    models: ModelSet,
    rewards: RewardRegistry,
    spec: ExperienceSpec,
    rows: list[int],
    generation: GenerationOutput,
    texts: tuple[str, ...],
    tokenizer_lock: threading.Lock,
    clock: PhaseClock | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The request's reward recipe: sum of weight x source, (B,) float32 on the CPU.

    Fields: info reward/<source> (each source's raw values) and the reward before shaping.
    The reward model reads the generated rows; rules and user functions get decoded prompt
    and response texts and the ground-truth answers. `clock` times the reward model
    (score_reward_model) apart from the other sources (rewards).
    """
    clock = clock or PhaseClock(models.device)
    prompts: list[str] = []
    if any(source != REWARD_MODEL_SOURCE for source, _ in spec.rewards):
        with clock.phase("rewards"), tokenizer_lock:
            decoded = {p: models.tokenizer.decode(spec.prompts[p]) for p in set(rows)}
        prompts = [decoded[p] for p in rows]
    total = torch.zeros(len(rows), dtype=torch.float32)
    info: dict[str, torch.Tensor] = {}
    for source, weight in spec.rewards:
        if source == REWARD_MODEL_SOURCE:
            with clock.phase("score_reward_model"):
                raw = reward_scores(
                    models.reward.module,
                    generation.sequences,
                    generation.attention_mask,
                    forward_batch_size=spec.forward_batch_rows,
                ).cpu()
        else:
            gts = [spec.gt_answers[p] for p in rows]
            with clock.phase("rewards"):
                raw = torch.tensor(
                    rewards.score(source, prompts, list(texts), gts), dtype=torch.float32
                )
        info[f"reward/{source}"] = raw
        total += weight * raw
    return total, info


def shape_batch(spec: ExperienceSpec, scored: ScoredBatch, policy_version: int) -> Experience:
    """Shape rewards, KL and advantages of scored rows (the algorithm); the rows as an
    Experience.

    Fields: reward, kl, advantages, returns, the final action_mask and the algorithm's info
    (algorithms.shape_experience); policy_version, prompt_index (to_experience); info
    time/shape_s (its seconds, spread over the rows).
    """
    generation = scored.generation
    device = generation.action_log_probs.device
    clock = PhaseClock(device)
    with clock.phase("shape"):
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
            experience_rows=spec.micro_batch_rows,
            truncated=generation.truncated,
            reward_moments=spec.reward_moments,
        )
    times, key = dict(scored.times), phase_key("shape")
    if key in times:  # spread over the rows shaped together (the whole request when whitened)
        times[key] = times[key] + clock.seconds["shape"] / times[key].numel()
    return to_experience(
        replace(scored, times=times),
        shaped,
        policy_version=policy_version,
        return_entropy=spec.return_entropy,
        return_texts=spec.return_texts,
    )
