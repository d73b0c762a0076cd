"""LightRFT's filters: high-entropy tokens, dynamic sampling and clip-filter weights."""

from __future__ import annotations

import torch

from .groups import group_view

__all__ = ["high_entropy_mask", "dynamic_sampling_mask", "clip_filter_weights"]


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """Float mask of the top-k entropy tokens per row, k = max(1, floor(n * ratio)), n = sum(m).

    entropy, mask: (B, A) -> (B, A) float32. ratio <= 0 or >= 1 returns the action mask as a
    float copy. Rows with no valid token select nothing. Masked entries score 0, so, as in
    LightRFT, they can only be picked when fewer than k valid entries have positive entropy;
    ties keep the lower column (stable sort) so the result is deterministic.
    """
    if ratio <= 0 or ratio >= 1:
        return mask.to(torch.float32).clone()
    valid = mask.bool()
    counts = valid.sum(dim=-1)  # (B,)
    k = torch.clamp(torch.floor(counts.to(torch.float64) * ratio).long(), min=1)  # (B,)
    k = torch.where(counts > 0, k, torch.zeros_like(k))
    scores = entropy.to(torch.float32) * valid.to(torch.float32)  # (B, A)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # (B, A)
    rank = torch.empty_like(order)
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank.scatter_(-1, order, positions)  # rank[b, j] = place of column j in the sort
    return (rank < k[:, None]).to(torch.float32)  # (B, A)


def dynamic_sampling_mask(
    reward: torch.Tensor, mask: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Zero the action mask of every group whose rewards are all 0 or all 1.

    reward: (B,) raw recipe reward; mask: (B, A) -> (B, A) bool. Such groups carry no learning
    signal under a 0/1 accuracy reward (every advantage is 0).
    """
    r = group_view(reward, group_size)  # (G, n)
    dead = (r == 0).all(dim=-1) | (r == 1).all(dim=-1)  # (G,)
    dead_rows = dead.repeat_interleave(group_size)  # (B,)
    return mask.bool() & ~dead_rows[:, None]


def clip_filter_weights(
    reward: torch.Tensor, group_size: int, clip_eps: float, *, zero_var_weight: float = 1.0
) -> torch.Tensor:
    """LightRFT's clip_filter_like_weight per row. reward: (B,) -> (B,)

    Over the G prompts, let z be those whose samples all got the same reward. If every prompt
    is in z the weights are 1; otherwise every weight is min(G / (G - |z|), clip_eps) and the
    prompts in z get zero_var_weight (LightRFT's `lamda`). "Same reward" is tested as max == min
    rather than std == 0 so float rounding in the std cannot hide a constant group; with n = 1
    every prompt is constant, so all weights are 1.
    """
    r = group_view(reward, group_size)  # (G, n)
    num_prompts = r.shape[0]
    constant = r.amax(dim=-1) == r.amin(dim=-1)  # (G,)
    num_constant = int(constant.sum().item())
    if num_constant == num_prompts:
        weights = torch.ones(num_prompts, dtype=torch.float32, device=reward.device)
    else:
        scale = min(num_prompts / (num_prompts - num_constant), clip_eps)
        weights = torch.full((num_prompts,), scale, dtype=torch.float32, device=reward.device)
        weights[constant] = zero_var_weight
    return weights.repeat_interleave(group_size)  # (B,)
