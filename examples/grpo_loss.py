"""The GRPO trainer's tensor math: policy log-probs in the wire layout, the clipped policy loss
and the k3 KL penalty. Plain functions, no state.

Layout (rollout.proto): sequences (B, S) with S = P + A, prompts left-padded, responses
right-padded; action column j is token P + j and is scored by the logits at position P + j - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossParts:
    """One mini-batch's loss and the statistics the trainer logs."""

    loss: torch.Tensor  # () the value to backpropagate
    policy_loss: float
    kl: float  # masked mean k3 KL to the reference (0 without one)
    clip_fraction: float  # share of valid tokens whose ratio was clipped
    approx_kl_old: float  # masked mean of (old - new) log-prob: how far the policy moved


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) positions counted from each row's first real token, as the server scores them."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # (B, S)


def policy_log_probs(
    model: torch.nn.Module,
    sequences: torch.Tensor,  # (B, S) int64
    attention_mask: torch.Tensor,  # (B, S) bool
    num_actions: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """(B, A) log-softmax(logits / temperature) at each response token, with gradients."""
    out = model(
        input_ids=sequences,
        attention_mask=attention_mask.long(),
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    # Positions S - A - 1 .. S - 2 predict the A action tokens.
    logits = out.logits[:, -num_actions - 1 : -1].float() / temperature  # (B, A, V)
    targets = sequences[:, -num_actions:]  # (B, A)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def masked_mean_per_row(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) mean of each row's valid columns; a row without any valid column gives 0."""
    mask = mask.to(values.dtype)  # (B, A)
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def k3_kl(log_probs: torch.Tensor, base_log_probs: torch.Tensor) -> torch.Tensor:
    """(B, A) k3 estimate of KL(policy || reference): exp(d) - d - 1 with d = base - policy.

    Unbiased and never negative (Schulman's estimator, the GRPO paper's KL term). d is clamped
    so one far-off token cannot overflow exp.
    """
    d = (base_log_probs - log_probs).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


def grpo_loss(
    log_probs: torch.Tensor,  # (B, A) current policy, with gradients
    old_log_probs: torch.Tensor,  # (B, A) the policy that sampled the rows (experience)
    advantages: torch.Tensor,  # (B, A)
    action_mask: torch.Tensor,  # (B, A) bool
    *,
    clip_eps: float = 0.2,
    base_log_probs: torch.Tensor | None = None,  # (B, A) reference model, for the KL term
    kl_coef: float = 0.0,
) -> LossParts:
    """PPO's clipped surrogate plus kl_coef * k3 KL, each a per-row masked mean, then a batch
    mean (the GRPO paper's aggregation: every response weighs the same, whatever its length)."""
    ratio = torch.exp(log_probs - old_log_probs)  # (B, A)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    surrogate = -torch.minimum(ratio * advantages, clipped * advantages)  # (B, A)
    policy_loss = masked_mean_per_row(surrogate, action_mask).mean()
    kl = torch.zeros((), device=log_probs.device)
    if base_log_probs is not None and kl_coef > 0:
        kl = masked_mean_per_row(k3_kl(log_probs, base_log_probs), action_mask).mean()
    valid = action_mask.float()
    n_valid = valid.sum().clamp(min=1.0)
    with torch.no_grad():
        clip_fraction = float((((ratio - 1.0).abs() > clip_eps).float() * valid).sum() / n_valid)
        approx_kl_old = float(((old_log_probs - log_probs) * valid).sum() / n_valid)
    return LossParts(
        loss=policy_loss + kl_coef * kl,
        policy_loss=float(policy_loss.detach()),
        kl=float(kl.detach()),
        clip_fraction=clip_fraction,
        approx_kl_old=approx_kl_old,
    )
