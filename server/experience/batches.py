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

__all__ = ["ScoredBatch", "fetch_to_cpu", "merge_batches", "to_experience"]


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
    """The whole batch as an Experience on the CPU (float32, bool masks).

    Every device tensor comes to the host in one go (fetch_to_cpu): copies into pinned
    memory queued behind the shaping kernels, one wait for all of them.
    """
    generation = scored.generation
    rows = generation.sequences.shape[0]
    host = fetch_to_cpu(
        {
            "sequences": generation.sequences,
            "attention_mask": generation.attention_mask,
            "response_lengths": generation.response_lengths,
            "truncated": generation.truncated,
            "rollout_log_probs": generation.action_log_probs,
            "action_mask": shaped.action_mask,
            "action_log_probs": shaped.action_log_probs,
            "base_action_log_probs": shaped.base_action_log_probs,
            "values": scored.values,
            "reward": shaped.reward,
            "kl": shaped.kl,
            "advantages": shaped.advantages,
            "returns": shaped.returns,
            "entropy": scored.entropy if return_entropy else None,
            **{f"info/{key}": value for key, value in shaped.info.items()},
        }
    )
    info = {key: host[f"info/{key}"] for key in shaped.info}
    info.update(scored.reward_info)
    info.update(scored.times)
    info["response_length"] = host["response_lengths"].to(torch.int64)
    info["total_length"] = host["attention_mask"].sum(-1).to(torch.int64)
    info["truncated"] = host["truncated"].to(torch.bool)
    return Experience(
        sequences=host["sequences"],
        attention_mask=host["attention_mask"].bool(),
        action_mask=host["action_mask"].bool(),
        action_log_probs=host["action_log_probs"].float(),
        base_action_log_probs=_float(host["base_action_log_probs"]),
        values=_float(host["values"]),
        reward=host["reward"].float(),
        kl=host["kl"].float(),
        advantages=host["advantages"].float(),
        returns=host["returns"].float(),
        action_entropy=_float(host["entropy"]),
        # The behaviour log-probs, recorded by the generation forward while sampling.
        rollout_log_probs=host["rollout_log_probs"].float(),
        info=info,
        policy_version=torch.full((rows,), policy_version, dtype=torch.int64),
        prompt_index=scored.prompt_index.clone(),
        response_texts=scored.texts if return_texts else None,
    )


def fetch_to_cpu(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """The same tensors on the CPU (detached; None stays None; CPU tensors as they are).

    CUDA tensors are copied without blocking into pinned host memory, each copy queued on
    its device's current stream right behind the kernels that make the tensor, and the host
    waits once for the last of them. A plain `.cpu()` per tensor would wait for the device
    and go through pageable memory once per tensor, a dozen and more times per batch.
    """
    out: dict[str, torch.Tensor | None] = {}
    streams: dict[torch.device, torch.cuda.Stream] = {}
    for name, tensor in tensors.items():
        if tensor is None:
            out[name] = None
            continue
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            out[name] = tensor.to("cpu")
            continue
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out[name] = host.copy_(tensor, non_blocking=True)
        streams.setdefault(tensor.device, torch.cuda.current_stream(tensor.device))
    for stream in streams.values():
        stream.synchronize()  # the copies are done: the host may read every tensor now
    return out


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


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()
