"""Advantages and returns from token rewards: GAE, cumulative returns, whitening, clipping.

GAE serves all three frameworks. OpenRLHF and LightRFT multiply the values and rewards by the
action mask first; ColossalChat runs the same recursion with no mask inside, but its inputs are
already masked (values = critic * m, rewards 0 past the response end), so masking them again
changes nothing and one function reproduces all three (tests/test_algorithms_advantages.py
checks this against coati's unmasked loop).
"""

from __future__ import annotations

import torch

__all__ = [
    "WHITENINGS",
    "gae",
    "cumulative_returns",
    "experience_slices",
    "normalise_experiences",
    "whiten",
    "clip_advantages",
    "clip_fraction",
    "cpgd_advantages",
]

WHITENINGS = ("none", "global", "global_mean", "unbiased")


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float | torch.Tensor,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over all A columns. (B, A) x 3 -> (advantages, returns)

    gamma: one float, or (B,) per row (LightRFT's gamma quirk gives rows different discounts).

    V <- V * m and r <- r * m, then backwards with V_A = 0:
        delta_t = r_t + gamma * V_{t+1} - V_t
        adv_t   = delta_t + gamma * lam * adv_{t+1}
    returns = adv + V (the masked V). Masked columns still carry the recursion, as upstream.
    """
    m = mask.to(rewards.dtype)
    values = values.to(rewards.dtype) * m  # (B, A)
    rewards = rewards * m  # (B, A)
    num_actions = rewards.shape[-1]
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])  # (B,) V_A = 0
    running = torch.zeros_like(rewards[:, 0])  # (B,) adv_{t+1}
    for t in reversed(range(num_actions)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
        next_value = values[:, t]
    return advantages, advantages + values


def cumulative_returns(
    rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float | torch.Tensor
) -> torch.Tensor:
    """REINFORCE returns G_t = r_t * m_t + gamma * G_{t+1}, G_A = 0. (B, A) x 2 -> (B, A)

    gamma: one float, or (B,) per row.
    """
    rewards = rewards * mask.to(rewards.dtype)  # (B, A)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns


def whiten(
    advantages: torch.Tensor, mask: torch.Tensor, mode: str, *, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise advantages with statistics over the valid entries of all rows. (B, A) -> (B, A)

    "global" (OpenRLHF, LightRFT cross-batch): mu = sum(A m) / sum(m), biased
    var = sum((A - mu)^2 m) / sum(m), A <- (A - mu) * rsqrt(max(var, 1e-8)).
    "global_mean": A <- A - mu (OpenRLHF's no_std_norm).
    "unbiased" (LightRFT advantages_norm): A <- (A - mu) / (std_unbiased + eps).
    Every mode transforms EVERY column, masked ones included (a trailing 0 becomes -mu * ...),
    as upstream does; the trainer's loss masks them. With no valid entry the input is returned
    unchanged; "unbiased" with a single valid entry only subtracts the mean (std undefined).
    """
    if mode == "none":
        return advantages
    if mode not in WHITENINGS:
        raise ValueError(f"unknown whitening {mode!r}; expected one of {WHITENINGS}")
    m = mask.to(advantages.dtype)
    count = m.sum()
    if count.item() == 0:
        return advantages
    mean = (advantages * m).sum() / count
    centred = advantages - mean  # (B, A)
    if mode == "global_mean":
        return centred
    if mode == "global":
        var = (centred.square() * m).sum() / count
        return centred * torch.rsqrt(var.clamp(min=1e-8))
    if count.item() < 2:
        return centred
    std = advantages[mask.bool()].std()  # Bessel-corrected
    return centred / (std + eps)


def experience_slices(num_rows: int, experience_rows: int | None) -> list[slice]:
    """The row ranges of a request's experiences, in order: consecutive blocks of
    experience_rows rows (the last may be shorter); None or 0: one experience of every row."""
    if not experience_rows or experience_rows >= num_rows:
        return [slice(0, num_rows)]
    return [
        slice(s, min(s + experience_rows, num_rows)) for s in range(0, num_rows, experience_rows)
    ]


def normalise_experiences(
    advantages: torch.Tensor, mask: torch.Tensor, experience_rows: int | None, *, eps: float
) -> torch.Tensor:
    """LightRFT's advantages_norm: "unbiased" whitening of each experience on its own.

    (B, A) x 2 -> (B, A). Each block of experience_rows rows gets (A - mean) / (std + eps)
    with the mean and Bessel-corrected std of its valid entries, applied to all its columns.
    """
    out = advantages.clone()
    for rows in experience_slices(advantages.shape[0], experience_rows):
        out[rows] = whiten(advantages[rows], mask[rows], "unbiased", eps=eps)
    return out


def cpgd_advantages(
    reward: torch.Tensor,
    mask: torch.Tensor,
    experience_rows: int | None,
    *,
    eps: float = 1e-6,
    collapse_quirk: bool = False,
) -> torch.Tensor:
    """LightRFT's CPGD advantage: the z-score of each row's reward within its experience,
    (R - mean) / (std_biased + eps), on the row's valid columns (0 elsewhere); returns equal it.

    reward: (B,) the recipe reward (LightRFT's info["reward"], before any shaping); mask:
    (B, A) -> (B, A). collapse_quirk: LightRFT's own result for such 1-D rewards, identically
    0 (it sums the reward over its last dimension, which leaves one scalar whose std is 0).
    """
    m = mask.to(reward.dtype)
    if collapse_quirk:
        return torch.zeros_like(m)
    out = torch.zeros_like(m)  # (B, A)
    for rows in experience_slices(reward.shape[0], experience_rows):
        r = reward[rows]  # (b,)
        z = (r - r.mean()) / (r.std(unbiased=False) + eps)  # (b,)
        out[rows] = z[:, None] * m[rows]
    return out


def clip_advantages(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """Clamp to [-clip, clip]; clip <= 0 disables. (B, A) -> (B, A)"""
    return advantages.clamp(min=-clip, max=clip) if clip > 0 else advantages


def clip_fraction(advantages: torch.Tensor, mask: torch.Tensor, clip: float) -> torch.Tensor:
    """Per row, the share of valid columns that clip_advantages changes. (B, A) x 2 -> (B,)

    Entries strictly outside [-clip, clip] before the clamp, over the row's valid columns (0
    for a row with none), so that sum(frac * valid columns) / sum(valid columns) is a batch's
    fraction whatever width its micro-batches are trimmed to. LightRFT divides by every column
    of its padded experience instead, masked ones included.
    """
    m = mask.to(advantages.dtype)
    outside = ((advantages > clip) | (advantages < -clip)).to(advantages.dtype) * m  # (B, A)
    return outside.sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)  # (B,)
