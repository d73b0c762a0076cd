"""One generation batch between the steps: ScoredBatch, joining batches, its Experience.

A ScoredBatch holds rows that are generated, scored and rewarded but not shaped yet, on the
models' device, in the batch's own layout (prompts left-padded to P, responses right-padded to
A). to_experience turns a shaped batch into the Experience the client receives (CPU, float32,
bool masks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ...client.protocol.experience import Experience
from ..algorithms import ShapedExperience
from .generation import GenerationOutput

__all__ = ["ScoredBatch", "merge_batches", "to_experience"]


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
    # "time/<phase>_s" and "time/generated_tokens_per_s": (B,) float32 (timing.py)
    times: dict[str, torch.Tensor] = field(default_factory=dict)


def to_experience(
    scored: ScoredBatch,
    shaped: ShapedExperience,
    *,
    policy_version: int,
    return_entropy: bool,
    return_texts: bool,
) -> Experience:
    """The whole batch as an Experience on the CPU (float32, bool masks)."""
    generation = scored.generation
    rows = generation.sequences.shape[0]
    info = {key: _cpu(value) for key, value in shaped.info.items()}
    info.update(scored.reward_info)
    info.update(scored.times)
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
        action_entropy=_float(_cpu(scored.entropy)) if return_entropy else None,
        # The behaviour log-probs, recorded by the generation forward while sampling.
        rollout_log_probs=_cpu(generation.action_log_probs).float(),
        info=info,
        policy_version=torch.full((rows,), policy_version, dtype=torch.int64),
        prompt_index=scored.prompt_index.clone(),
        response_texts=scored.texts if return_texts else None,
    )


def merge_batches(batches: list[ScoredBatch], pad_token_id: int) -> ScoredBatch:
    """Join generation batches into one, padded to a common layout (prompt left, response
    right): the whole request, for shaping that takes statistics over every row."""
    if len(batches) == 1:
        return batches[0]
    width_p = max(b.generation.prompt_width for b in batches)
    width_a = max(b.generation.action_mask.shape[1] for b in batches)
    padded = [_pad_batch(b, width_p, width_a, pad_token_id) for b in batches]
    generation = replace(
        padded[0].generation,
        **{
            name: torch.cat([getattr(b.generation, name) for b in padded])
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
        prompt_index=torch.cat([b.prompt_index for b in padded]),
        actor_log_probs=_cat([b.actor_log_probs for b in padded]),
        reference_log_probs=_cat([b.reference_log_probs for b in padded]),
        values=_cat([b.values for b in padded]),
        entropy=_cat([b.entropy for b in padded]),
        rewards=torch.cat([b.rewards for b in padded]),
        reward_info={
            key: torch.cat([b.reward_info[key] for b in padded]) for key in padded[0].reward_info
        },
        texts=tuple(t for b in padded for t in b.texts),
        times={key: torch.cat([b.times[key] for b in padded]) for key in padded[0].times},
    )


def _pad_batch(b: ScoredBatch, width_p: int, width_a: int, pad_token_id: int) -> ScoredBatch:
    """b with its prompts left-padded to width_p and its action columns right-padded to width_a
    (pad tokens, false masks, zero scores)."""
    g = b.generation
    actions = g.action_mask.shape[1]
    tokens = (width_p - g.prompt_width, width_a - actions)  # (left, right) pad of (B, S)
    columns = (0, width_a - actions)  # right pad of (B, A)

    def pad(t: torch.Tensor | None, value: float = 0) -> torch.Tensor | None:
        return None if t is None else torch.nn.functional.pad(t, columns, value=value)

    generation = replace(
        g,
        sequences=torch.nn.functional.pad(g.sequences, tokens, value=pad_token_id),
        attention_mask=torch.nn.functional.pad(g.attention_mask, tokens, value=False),
        action_mask=pad(g.action_mask, False),
        action_log_probs=pad(g.action_log_probs),
        prompt_width=width_p,
    )
    return replace(
        b,
        generation=generation,
        actor_log_probs=pad(b.actor_log_probs),
        reference_log_probs=pad(b.reference_log_probs),
        values=pad(b.values),
        entropy=pad(b.entropy),
    )


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat(parts)


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu")


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()
