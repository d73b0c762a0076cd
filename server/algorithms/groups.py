"""Group estimators: shape each row's scalar reward with the rewards of its prompt's group.

Rows of one prompt are consecutive (B = num_prompts * n). With R the (num_prompts, n) view:

    group_norm          (R - mean) / (std_unbiased + eps)       GRPO
    dr_grpo             R - mean                                Dr. GRPO (no std division)
    reinforce_baseline  R - mean                                REINFORCE++ baseline
    rloo                R - (sum - R) / (n - 1)                 leave-one-out baseline
    gae, reinforce      R unchanged
    cpgd                R unchanged (its advantage is a z-score per experience: advantages.py)

n = 1 is defined rather than left to NaN: rloo has no leave-one-out baseline and needs n >= 2
(`min_group_size`; the request decoder refuses smaller groups, naming samples_per_prompt);
every mean-based estimator gives 0, since the group mean is the reward itself.
"""

from __future__ import annotations

import torch

__all__ = [
    "ESTIMATORS",
    "GROUP_ESTIMATORS",
    "group_shaped_reward",
    "group_view",
    "min_group_size",
]

ESTIMATORS = ("gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "cpgd")
GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")


def min_group_size(estimator: str) -> int:
    """The fewest samples per prompt the estimator works with: 2 for rloo's leave-one-out
    baseline, 1 for every other."""
    return 2 if estimator == "rloo" else 1


def group_view(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) -> (B / n, n), one row per prompt."""
    if values.ndim != 1 or values.shape[0] % group_size != 0:
        raise ValueError(
            f"expected (B,) with B a multiple of {group_size}, got {tuple(values.shape)}"
        )
    return values.view(-1, group_size)


def group_shaped_reward(
    reward: torch.Tensor, group_size: int, estimator: str, *, eps: float
) -> torch.Tensor:
    """Apply the group estimator to the scalar rewards. (B,) -> (B,)"""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    if estimator not in GROUP_ESTIMATORS:
        return reward
    if group_size < min_group_size(estimator):
        raise ValueError(f"estimator {estimator!r} needs groups of >= 2 rows, got {group_size}")
    r = group_view(reward, group_size)  # (G, n)
    if estimator == "rloo":
        baseline = (r.sum(dim=-1, keepdim=True) - r) / (group_size - 1)  # (G, n)
        return (r - baseline).flatten()
    centred = r - r.mean(dim=-1, keepdim=True)  # (G, n)
    if estimator in ("dr_grpo", "reinforce_baseline"):
        return centred.flatten()
    # group_norm. A group of equal rewards gets exactly 0: with float rounding, R - mean and
    # the std can both be ~1e-8 instead of 0, and their ratio would be noise of order 1.
    if group_size > 1:
        std = r.std(dim=-1, keepdim=True)  # (G, 1) Bessel-corrected
    else:
        std = torch.zeros_like(r)
    constant = (r.amax(dim=-1) == r.amin(dim=-1))[:, None]  # (G, 1)
    normalised = centred / (std + eps)
    return torch.where(constant, torch.zeros_like(normalised), normalised).flatten()
