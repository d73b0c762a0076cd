"""Per-token KL estimators between the actor and the reference policy.

With d = logp - logp_ref per action column (the log-ratio of the sampled token):

    k1 = d                  unbiased, signed
    k2 = d^2 / 2            biased, >= 0
    k3 = exp(-d) - 1 + d    unbiased for KL(actor || ref), >= 0 (Schulman's estimator)

Two framework conventions are options rather than hard-coded (presets.py's table):
LightRFT multiplies d by the action mask *before* the transform (`mask` argument), OpenRLHF
clamps the result symmetrically to [-10, 10] (`clamp`, applied after the transform, so it
also bounds k1 from below). ColossalChat's logged KL is a different, quirky quantity and has
its own function, `coati_logged_kl`, used only for the returned `kl` of the coati preset.
"""

from __future__ import annotations

import torch

from .masking import float_dtype, masked_row_mean

__all__ = ["KL_ESTIMATORS", "kl_estimate", "coati_logged_kl", "sequence_kl_reward"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    *,
    estimator: str = "k1",
    mask: torch.Tensor | None = None,
    clamp: float = 0.0,
) -> torch.Tensor:
    """Per-token KL estimate k1, k2 or k3; optional mask-before-transform and +-clamp.

    log_probs, ref_log_probs: (B, A); mask: (B, A) or None; clamp 0 disables -> (B, A)
    """
    dtype = float_dtype(log_probs)
    d = log_probs.to(dtype) - ref_log_probs.to(dtype)  # (B, A)
    if mask is not None:
        # Masking d (not the result) is enough for every estimator: each maps d = 0 to 0.
        d = d * mask.to(dtype)
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = d.square() / 2
    elif estimator == "k3":
        # Written as the frameworks write it (not expm1) so float32 results match theirs.
        kl = torch.exp(-d) - 1 + d
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    if clamp > 0:
        kl = kl.clamp(min=-clamp, max=clamp)
    return kl  # (B, A)


def coati_logged_kl(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """ColossalChat V2's logged KL: (exp(g) - 1 - d) * m with g = d if d < 10 else 0.

    (B, A) x 3 -> (B, A). Note the orientation: this is exp(d) - 1 - d, not the usual
    exp(-d) - 1 + d, and the overflow guard makes it -d (negative) for d >= 10. coati only
    logs this value; its token reward uses -beta * d. Reproduced for the coati preset's
    returned `kl` so that trainers comparing logs see the same numbers.
    """
    dtype = float_dtype(log_probs)
    d = log_probs.to(dtype) - ref_log_probs.to(dtype)  # (B, A)
    g = torch.where(d < 10, d, torch.zeros_like(d))
    return (torch.exp(g) - 1 - d) * mask.to(dtype)  # (B, A)


def sequence_kl_reward(kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """ColossalChat GRPO's sequence KL term: -beta * masked mean of the per-token KL.

    kl, mask: (B, A) -> (B,). Added to the scalar reward before group normalisation.
    """
    return -kl_coef * masked_row_mean(kl, mask)  # (B,)
