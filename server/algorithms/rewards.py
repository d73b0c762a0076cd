"""Scalar reward shaping and the per-token reward built from it.

The scalar reward R (B,) is the recipe's reward per row. Shaping, in the order the frameworks
apply it: an optional overlong penalty on R, the group estimator (groups.py), a clip of the
result, then the token reward (B, A) = -beta * kl + R placed on the action columns:

* "last": R at the last valid column (OpenRLHF, LightRFT); a row with no valid column puts R
  at column A - 1, as both frameworks do.
* "every": R added to every valid column (ColossalChat PPO), so with gamma = 1 the return at
  column 0 scales with the response length.
"""

from __future__ import annotations

import torch

from .masking import last_valid_column, response_span

__all__ = [
    "REWARD_PLACEMENTS",
    "OVERLONG_VARIANTS",
    "OVERLONG_LENGTHS",
    "clip_reward",
    "response_length",
    "stop_properly_penalty",
    "overlong_penalty",
    "place_reward",
    "token_rewards",
]

REWARD_PLACEMENTS = ("last", "every")
# "capped": OpenRLHF's DAPO penalty, never below -factor. "uncapped": LightRFT's, which only
# clamps at 0 from above and so keeps falling past -factor when the length exceeds the budget.
OVERLONG_VARIANTS = ("capped", "uncapped")
# The response length the overlong penalty measures: "span" (OpenRLHF's response_length, first
# to last action column) or "count" (LightRFT's sum of the action mask). They differ only for a
# mask with gaps (multi-turn rows).
OVERLONG_LENGTHS = ("span", "count")


def clip_reward(reward: torch.Tensor, clip: float) -> torch.Tensor:
    """Clip to [-clip, clip]; clip <= 0 disables. (B,) -> (B,)"""
    return reward.clamp(min=-clip, max=clip) if clip > 0 else reward


def overlong_penalty(
    response_length: torch.Tensor,
    *,
    max_new_tokens: int,
    buffer_tokens: int,
    factor: float,
    variant: str,
) -> torch.Tensor:
    """DAPO overlong penalty (<= 0) to add to the scalar reward. (B,) lengths -> (B,)

    With L the response length, M the token budget and b the buffer, the excess is
    x = L - (M - b). "capped" (OpenRLHF): -min(x, b) / b * factor when x > 0, else 0.
    "uncapped" (LightRFT): min(0, -x / b * factor).
    """
    dtype = response_length.dtype if response_length.is_floating_point() else torch.float32
    if buffer_tokens <= 0 or factor == 0:
        return torch.zeros_like(response_length, dtype=dtype)
    excess = response_length.to(dtype) - (max_new_tokens - buffer_tokens)  # (B,)
    if variant == "capped":
        excess = excess.clamp(max=buffer_tokens)
        penalty = torch.where(
            excess > 0, -excess / buffer_tokens * factor, torch.zeros_like(excess)
        )
    elif variant == "uncapped":
        penalty = (-excess / buffer_tokens * factor).clamp(max=0.0)
    else:
        raise ValueError(
            f"unknown overlong variant {variant!r}; expected one of {OVERLONG_VARIANTS}"
        )
    return penalty  # (B,)


def response_length(mask: torch.Tensor, measure: str, dtype: torch.dtype) -> torch.Tensor:
    """The length the overlong penalty measures, as `dtype`. (B, A) -> (B,)"""
    if measure == "span":
        return response_span(mask).to(dtype)
    if measure == "count":
        return mask.bool().sum(dim=-1).to(dtype)
    raise ValueError(f"unknown overlong length {measure!r}; expected one of {OVERLONG_LENGTHS}")


def stop_properly_penalty(
    reward: torch.Tensor, truncated: torch.Tensor, coef: float
) -> torch.Tensor:
    """ProRL's truncation penalty (OpenRLHF's stop_properly_penalty_coef). (B,) x 2 -> (B,)

    For the rows truncated by the token budget: R <- coef when coef < 0 (a fixed penalty),
    else R * coef (coef = 0 zeroes their reward, 1 keeps it). Other rows are unchanged.
    """
    penalised = torch.full_like(reward, coef) if coef < 0 else reward * coef
    return torch.where(truncated.bool(), penalised, reward)


def place_reward(reward: torch.Tensor, mask: torch.Tensor, placement: str) -> torch.Tensor:
    """Spread a scalar reward over the action columns. (B,), (B, A) -> (B, A)"""
    batch, num_actions = mask.shape
    if placement == "every":
        return reward[:, None] * mask.to(reward.dtype)  # (B, A)
    if placement == "last":
        placed = torch.zeros(batch, num_actions, dtype=reward.dtype, device=reward.device)
        placed.scatter_(1, last_valid_column(mask)[:, None], reward[:, None])
        return placed  # (B, A)
    raise ValueError(f"unknown reward placement {placement!r}; expected one of {REWARD_PLACEMENTS}")


def token_rewards(
    reward: torch.Tensor,
    mask: torch.Tensor,
    *,
    placement: str,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Token reward -kl_coef * kl + placed scalar reward. (B,), (B, A), (B, A)|None -> (B, A)

    The KL is not re-masked here (OpenRLHF): the returns and GAE mask the rewards themselves.
    """
    placed = place_reward(reward, mask, placement)  # (B, A)
    if kl is None or kl_coef == 0:
        return placed
    return -kl_coef * kl.to(placed.dtype) + placed
