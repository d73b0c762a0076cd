"""The one entry point the experience maker calls after generation and scoring.

`shape_experience` turns scored rows into the RL fields of an Experience, in this order (the
order OpenRLHF and LightRFT apply their steps; coati's two branches are special cases):

 1. zero the log-probs outside the action mask (zero_invalid_logprobs, OpenRLHF);
 2. per-token KL (B, A) with the configured estimator, mask-first and clamp;
 3. overlong penalty on the scalar reward (length: the response span or the count of valid
    action columns), then ProRL's truncation penalty (stop_properly_penalty);
 4. kl_mode "sequence": add -beta * masked mean KL to the scalar reward (coati GRPO);
    the result is the stored `reward`;
 5. dynamic sampling: zero the action mask of groups whose raw rewards are all 0 or all 1
    (the KL of step 2 keeps the original mask, as in LightRFT, which computes it earlier);
 6. group estimator on the scalar reward, then LightRFT's running reward normalisation (per
    experience, in order, with the request's running moments), then the reward clip;
 7. token reward: placed scalar, minus beta * KL when kl_mode is "reward";
 8. advantages: coati's broadcast of the group advantage, GAE, cumulative returns (with each
    experience's discount, AlgorithmConfig.gamma_of_experience), or CPGD's z-score of the
    recipe reward per experience;
 9. LightRFT's per-experience normalisation (experience_norm), then the whitening (if it
    applies to the estimator) and the advantage clip, in the preset's order: LightRFT clips
    each experience before its cross-batch whitening, the others clip after whitening.

An experience is a block of `experience_rows` consecutive rows (the request's micro-batch);
without it all B rows are one experience.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...client.protocol.reward_moments import RunningRewardMoments
from .advantages import (
    clip_advantages,
    clip_fraction,
    cpgd_advantages,
    cumulative_returns,
    experience_slices,
    gae,
    normalise_experiences,
    whiten,
)
from .filters import (
    clip_filter_weights,
    dynamic_sampling_mask,
    high_entropy_mask,
)
from .groups import group_shaped_reward
from .kl import coati_logged_kl, kl_estimate, sequence_kl_reward
from .masking import float_dtype, masked_row_mean
from .presets import AlgorithmConfig
from .rewards import (
    clip_reward,
    overlong_penalty,
    response_length,
    stop_properly_penalty,
    token_rewards,
)
from .running_norm import running_normalise

__all__ = ["ShapedExperience", "shape_experience"]


@dataclass(frozen=True)
class ShapedExperience:
    """The RL fields of B rows, as the configured framework would store them."""

    action_log_probs: torch.Tensor  # (B, A) zeroed off-mask when zero_invalid_logprobs
    base_action_log_probs: torch.Tensor | None  # (B, A) likewise; None without a reference
    kl: torch.Tensor  # (B, A) per-token KL as returned (coati: its logged quantity)
    token_rewards: torch.Tensor  # (B, A)
    advantages: torch.Tensor  # (B, A)
    returns: torch.Tensor  # (B, A)
    reward: torch.Tensor  # (B,) after the overlong penalty and the sequence KL, before groups
    action_mask: torch.Tensor  # (B, A) bool, possibly zeroed by dynamic sampling
    info: dict[str, torch.Tensor]  # leading dim B: "kl", "return", option-dependent extras


def _check_inputs(
    cfg: AlgorithmConfig,
    group_size: int,
    log_probs: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    others: dict[str, torch.Tensor | None],
) -> None:
    if log_probs.ndim != 2 or mask.shape != log_probs.shape:
        raise ValueError(
            f"action_log_probs {tuple(log_probs.shape)} and action_mask "
            f"{tuple(mask.shape)} must both be (B, A)"
        )
    if rewards.shape != log_probs.shape[:1]:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be (B,) = ({log_probs.shape[0]},)")
    if log_probs.shape[0] % group_size != 0:
        raise ValueError(f"{log_probs.shape[0]} rows are not whole groups of {group_size}")
    for name, tensor in others.items():
        if name != "truncated" and tensor is not None and tensor.shape != log_probs.shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} must match action_log_probs (B, A)")
    if others["base_action_log_probs"] is None and cfg.needs_reference:
        raise ValueError("kl_coef > 0 needs base_action_log_probs from the reference model")
    if others["entropy"] is None and cfg.needs_entropy:
        raise ValueError("high_entropy_token_ratio > 0 needs the action entropy")
    truncated = others["truncated"]
    if cfg.stop_properly_penalty is not None and truncated is None:
        raise ValueError("stop_properly_penalty needs truncated (B,)")
    if truncated is not None and truncated.shape != rewards.shape:
        raise ValueError(f"truncated {tuple(truncated.shape)} must be (B,)")


def _token_kl(
    cfg: AlgorithmConfig, log_probs: torch.Tensor, ref: torch.Tensor | None, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL used for shaping, KL returned); both (B, A), zeros without a reference."""
    if ref is None:
        zeros = torch.zeros_like(log_probs)
        return zeros, zeros
    kl = kl_estimate(
        log_probs,
        ref,
        estimator=cfg.kl_estimator,
        mask=mask if cfg.kl_mask_first else None,
        clamp=cfg.kl_clamp,
    )
    if cfg.coati_logged_kl and cfg.kl_estimator == "k1":
        return kl, coati_logged_kl(log_probs, ref, mask)
    return kl, kl


def _row_gammas(
    cfg: AlgorithmConfig, like: torch.Tensor, experience_rows: int | None
) -> float | torch.Tensor:
    """The discount of every row: one float, or (B,) when experiences differ (gamma quirk)."""
    slices = experience_slices(like.shape[0], experience_rows)
    gammas = [cfg.gamma_of_experience(i) for i in range(len(slices))]
    if len(set(gammas)) == 1:
        return gammas[0]
    per_row = torch.empty(like.shape[0], dtype=like.dtype, device=like.device)  # (B,)
    for rows, gamma in zip(slices, gammas, strict=True):
        per_row[rows] = gamma
    return per_row


def _advantages(
    cfg: AlgorithmConfig,
    shaped: torch.Tensor,
    rewards_bt: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    gamma: float | torch.Tensor,
    raw_rewards: torch.Tensor,
    experience_rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) before whitening; all (B, A)."""
    if cfg.estimator == "cpgd":
        quirk = "cpgd_zero_for_scalar_rewards" in cfg.upstream_quirks
        adv = cpgd_advantages(raw_rewards, mask, experience_rows, collapse_quirk=quirk)
        return adv, adv.clone()
    if cfg.broadcasts_sequence_advantage:
        # coati GRPO: the row's advantage on every column, masked or not; returns = advantages.
        adv = shaped[:, None].expand_as(rewards_bt).clone()
        return adv, adv.clone()
    if cfg.estimator == "gae":
        if values is None:
            raise ValueError("estimator 'gae' needs values (B, A) from the critic")
        return gae(rewards_bt, values, mask, gamma=gamma, lam=cfg.lam)
    returns = cumulative_returns(rewards_bt, mask, gamma=gamma)
    return returns.clone(), returns


def _scalar_reward(
    cfg: AlgorithmConfig,
    rewards: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    max_new_tokens: int,
    truncated: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stored reward (B,), sequence KL term (B,) or None): steps 3 and 4."""
    reward = rewards.to(kl.dtype)  # (B,)
    if cfg.uses_overlong_penalty:
        reward = reward + overlong_penalty(
            response_length(mask, cfg.overlong_length, kl.dtype),
            max_new_tokens=max_new_tokens,
            buffer_tokens=cfg.overlong_buffer,
            factor=cfg.overlong_factor,
            variant=cfg.overlong_variant,
        )
    if cfg.stop_properly_penalty is not None and truncated is not None:
        reward = stop_properly_penalty(reward, truncated, cfg.stop_properly_penalty)
    if cfg.kl_mode != "sequence":
        return reward, None
    sequence_kl = sequence_kl_reward(kl, mask, cfg.kl_coef)  # (B,)
    return reward + sequence_kl, sequence_kl


def length_normalized(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """coati's calc_masked_log_probs with length_normalization: l * m / (sum(m) + 0.01) per
    row, on the action columns. (B, A) x 2 -> (B, A); a row's sum is its mean log-prob."""
    m = mask.to(log_probs.dtype)
    return log_probs * m / (m.sum(dim=-1, keepdim=True) + 0.01)


def _extras(
    cfg: AlgorithmConfig,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor | None,
    group_size: int,
    log_probs: tuple[torch.Tensor, torch.Tensor | None],
) -> dict[str, torch.Tensor]:
    """The option-dependent info tensors (LightRFT's filters, coati's normalised log-probs)."""
    extras: dict[str, torch.Tensor] = {}
    if cfg.length_normalized_log_probs:
        actor, reference = log_probs
        extras["length_normalized_log_probs"] = length_normalized(actor, mask)  # (B, A)
        if reference is not None:
            extras["length_normalized_base_log_probs"] = length_normalized(reference, mask)
    if entropy is not None and cfg.needs_entropy:
        ratio = cfg.high_entropy_token_ratio
        extras["high_entropy_mask"] = high_entropy_mask(entropy, mask, ratio)  # (B, A)
    if cfg.clip_filter_eps > 0:
        extras["clip_filter_weight"] = clip_filter_weights(
            rewards, group_size, cfg.clip_filter_eps, zero_var_weight=cfg.clip_filter_lambda
        )  # (B,)
    return extras


def _normalise(
    cfg: AlgorithmConfig, advantages: torch.Tensor, mask: torch.Tensor, experience_rows: int | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Step 9: experience normalisation, whitening and the clip, in the preset's order;
    (advantages (B, A), info: "advantage_clip_frac" (B,) when the clip applies)."""
    info: dict[str, torch.Tensor] = {}

    def clip(adv: torch.Tensor) -> torch.Tensor:
        if not cfg.uses_advantage_clip:
            return adv
        info["advantage_clip_frac"] = clip_fraction(adv, mask, cfg.advantage_clip)
        return clip_advantages(adv, cfg.advantage_clip)

    if cfg.uses_experience_norm:
        advantages = normalise_experiences(advantages, mask, experience_rows, eps=cfg.whiten_eps)
    if cfg.clip_before_whitening:
        advantages = clip(advantages)
    advantages = whiten(advantages, mask, cfg.effective_whitening, eps=cfg.whiten_eps)
    if not cfg.clip_before_whitening:
        advantages = clip(advantages)
    return advantages, info


# Over 60 lines only through its keyword signature, docstring and the named result: the body is
# the numbered steps of the module docstring, in order, one line (or call) each.
def shape_experience(
    cfg: AlgorithmConfig,
    *,
    action_log_probs: torch.Tensor,
    base_action_log_probs: torch.Tensor | None,
    action_mask: torch.Tensor,
    values: torch.Tensor | None,
    rewards: torch.Tensor,
    group_size: int,
    max_new_tokens: int,
    entropy: torch.Tensor | None = None,
    experience_rows: int | None = None,
    truncated: torch.Tensor | None = None,
    reward_moments: RunningRewardMoments | None = None,
) -> ShapedExperience:
    """KL, token rewards, advantages and returns of B rows (whole groups, consecutive).

    Whitening statistics span all B rows, so pass the whole request, not one micro-batch
    (cfg.shapes_whole_request says when that matters); experience_rows: rows per experience
    (the request's micro-batch size), None: one experience. truncated: (B,) bool, the rows
    that hit the token budget (needed by stop_properly_penalty). reward_moments: the running
    moments before the first experience (cfg.uses_running_norm; None: no history); the moments
    after each row's experience come back in info (running_norm.running_normalise).
    Raises ValueError for inputs that break this function's contract (shapes, missing tensors,
    rows that are not whole groups, a group too small for the estimator).
    """
    others = {
        "base_action_log_probs": base_action_log_probs,
        "values": values,
        "entropy": entropy,
        "truncated": truncated,
    }
    _check_inputs(cfg, group_size, action_log_probs, action_mask, rewards, others)
    dtype = float_dtype(action_log_probs)
    mask = action_mask.bool()
    log_probs = action_log_probs.to(dtype)
    ref = None if base_action_log_probs is None else base_action_log_probs.to(dtype)
    if cfg.zero_invalid_logprobs:
        log_probs = log_probs * mask
        ref = None if ref is None else ref * mask

    kl, kl_out = _token_kl(cfg, log_probs, ref, mask)  # (B, A) x 2
    reward, sequence_kl = _scalar_reward(cfg, rewards, kl, mask, max_new_tokens, truncated)
    shaped_mask = dynamic_sampling_mask(rewards, mask, group_size) if cfg.dynamic_sampling else mask
    shaped = group_shaped_reward(reward, group_size, cfg.estimator, eps=cfg.group_std_eps)
    moments_info: dict[str, torch.Tensor] = {}
    if cfg.uses_running_norm:
        shaped, moments_info = running_normalise(
            shaped, reward_moments, experience_rows, cfg.reward_running_norm
        )
    shaped = clip_reward(shaped, cfg.reward_clip)  # (B,)
    rewards_bt = token_rewards(
        shaped,
        shaped_mask,
        placement=cfg.reward_placement,
        kl=kl if cfg.kl_mode == "reward" else None,
        kl_coef=cfg.kl_coef,
    )  # (B, A)
    gamma = _row_gammas(cfg, shaped, experience_rows)  # float or (B,)
    advantages, returns = _advantages(
        cfg, shaped, rewards_bt, values, shaped_mask, gamma, rewards.to(dtype), experience_rows
    )
    advantages, clip_info = _normalise(cfg, advantages, shaped_mask, experience_rows)

    info = {
        "kl": masked_row_mean(kl_out, mask),  # (B,)
        "return": rewards_bt.sum(dim=-1),  # (B,) over all columns, as OpenRLHF logs it
        **_extras(cfg, rewards, shaped_mask, entropy, group_size, (log_probs, ref)),
        **clip_info,
        **moments_info,
    }
    if sequence_kl is not None:
        info["sequence_kl"] = sequence_kl
    return ShapedExperience(
        action_log_probs=log_probs,
        base_action_log_probs=ref,
        kl=kl_out,
        token_rewards=rewards_bt,
        advantages=advantages,
        returns=returns,
        reward=reward,
        action_mask=shaped_mask,
        info=info,
    )
