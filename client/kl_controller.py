"""KL coefficient controllers for the trainer, and the mean KL they read from experience.

The trainer owns beta: after each PPO phase it calls `update(current_kl, n_steps)` and sends
`controller.value` as AlgorithmOptions.kl_coef with its next MakeExperience request.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FixedKLController", "AdaptiveKLController", "mean_kl"]


class FixedKLController:
    """A constant KL coefficient; `update` is a no-op so both controllers swap freely."""

    def __init__(self, value: float) -> None:
        if not value >= 0:
            raise ValueError(f"KL coefficient must be >= 0, got {value!r}")
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value!r})"


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller, as OpenRLHF and LightRFT implement it.

    e = clip(current_kl / target - 1, -0.2, 0.2); value <- value * (1 + e * n_steps / horizon).
    Both frameworks call it with n_steps = rollout_batch_size * n_samples_per_prompt.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if not init_kl_coef >= 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef!r}")
        if not target > 0:
            raise ValueError(f"target KL must be > 0, got {target!r}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon!r}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move the coefficient towards the target KL; returns the new value."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value!r}, target={self.target!r}, "
            f"horizon={self.horizon!r})"
        )


def mean_kl(*experiences: Any) -> float:
    """Mean over rows of each row's masked-mean KL, across one or more experiences.

    Duck-typed: each argument needs `kl` (B, A) and `action_mask` (B, A). Rows without any
    valid action (e.g. dropped by dynamic sampling) carry no KL and are left out; with no
    valid row at all the result is 0.0.
    """
    total = 0.0
    rows = 0
    for experience in experiences:
        kl = torch.as_tensor(experience.kl, dtype=torch.float64)
        mask = torch.as_tensor(experience.action_mask).to(torch.float64)
        valid = mask.sum(dim=-1)  # (B,)
        per_row = (kl * mask).sum(dim=-1) / valid.clamp(min=1.0)  # (B,)
        total += float(per_row[valid > 0].sum())
        rows += int((valid > 0).sum())
    return total / rows if rows else 0.0
