"""LightRFT's running reward normalisation (--reward_running_norm), without server state.

LightRFT keeps one RunningMoments per experience maker (per data-parallel rank) for the whole
run; for each experience of a step, in order, it first folds the experience's rewards into
the moments (Chan's parallel combination of the batch's mean and biased variance with the
running ones), then divides them by the updated std, after subtracting the updated mean with
--reward_running_norm_minus_mean:

    d = mean_x - mean            N = count + n
    M2 = var * count + var_x * n + d^2 * count * n / N
    mean <- mean + d * n / N     var <- M2 / N     count <- N
    std = sqrt(var * N / (N - 1))                  (no epsilon)
    R <- (R - mean) / std   or   R <- R / std

Its fresh moments are count 1e-24, mean 0, var 1. Here the moments come in with the request
and go out with each row (the state after the row's experience), so the trainer threads them
(client/protocol/reward_moments.py). The maths runs in float64 on the rewards' device with no
host round trip; LightRFT runs it in float32.
"""

from __future__ import annotations

import torch

from ...client.protocol.reward_moments import REWARD_MOMENTS_INFO_KEYS, RunningRewardMoments
from .advantages import experience_slices

__all__ = [
    "FRESH_MOMENTS",
    "RUNNING_NORMS",
    "running_normalise",
]

# "off"; "scale": R / std (LightRFT's --reward_running_norm alone); "standardize":
# (R - mean) / std (with --reward_running_norm_minus_mean).
RUNNING_NORMS = ("off", "scale", "standardize")

# LightRFT's RunningMoments() before any update: the tiny count keeps the prior out of every
# later mean, while its variance keeps M2 above 0, so no std is ever 0.
FRESH_MOMENTS = RunningRewardMoments(count=1e-24, mean=0.0, var=1.0)


def running_normalise(
    reward: torch.Tensor,
    moments: RunningRewardMoments | None,
    experience_rows: int | None,
    mode: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Normalise each experience's rewards with the running moments updated by it, in order.

    reward: (B,), every row of the request's experiences (blocks of experience_rows rows from
    row 0; None: one experience). moments: the state before the first experience (None or
    empty: LightRFT's fresh moments). Returns (the normalised reward (B,) in reward's dtype,
    info: REWARD_MOMENTS_INFO_KEYS -> (B,) float64, each row the moments after its experience).
    """
    if mode not in RUNNING_NORMS or mode == "off":
        raise ValueError(f"running_normalise: mode must be 'scale' or 'standardize', got {mode!r}")
    start = FRESH_MOMENTS if moments is None or moments.is_empty else moments
    device = reward.device
    f64 = dict(dtype=torch.float64, device=device)
    count = torch.tensor(start.count, **f64)
    mean = torch.tensor(start.mean, **f64)
    var = torch.tensor(start.var, **f64)
    x = reward.to(torch.float64)  # (B,)
    out = torch.empty_like(x)  # (B,)
    rows_info = {name: torch.empty(x.shape, **f64) for name in REWARD_MOMENTS_INFO_KEYS}
    for rows in experience_slices(x.shape[0], experience_rows):
        batch = x[rows]  # (n,)
        n = batch.numel()
        batch_var, batch_mean = torch.var_mean(batch, unbiased=False)
        delta = batch_mean - mean
        total = count + n
        m2 = var * count + batch_var * n + delta.square() * count * n / total
        mean = mean + delta * n / total
        var = m2 / total
        count = total
        # N - 1 == 0 (a first experience of one row) gives an infinite std, and a 0 reward,
        # as upstream; var > 0 always (the request's moments were checked), so never 0 / 0.
        std = (var * total / (total - 1)).sqrt()
        centred = batch - mean if mode == "standardize" else batch
        out[rows] = centred / std
        for name, value in (("count", count), ("mean", mean), ("var", var)):
            rows_info[name][rows] = value
    info = {REWARD_MOMENTS_INFO_KEYS[name]: values for name, values in rows_info.items()}
    return out.to(reward.dtype), info
