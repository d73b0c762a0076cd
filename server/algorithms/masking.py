"""Masked reductions over the action axis, shared by the KL, reward and advantage functions."""

from __future__ import annotations

import torch

__all__ = ["masked_row_mean", "last_valid_column", "response_span", "float_dtype"]


def float_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype to compute in: float64 stays float64, everything else (bf16, fp16) is float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def masked_row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of x over the valid columns; a row with no valid column gives 0.

    x: (B, A), mask: (B, A) bool or {0, 1} -> (B,)
    """
    m = mask.to(x.dtype)
    # clamp(min=1) instead of coati's +1e-8: identical for rows with >= 1 valid column and a
    # clean 0 (not 0/1e-8 noise) for empty rows.
    return (x * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)  # (B,)


def last_valid_column(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last valid column per row; a row with no valid column gives A - 1.

    mask: (B, A) -> (B,) int64. The A - 1 fallback is OpenRLHF's and LightRFT's: their
    `eos_indices` search lands on the last column when the mask is all zero.
    """
    num_actions = mask.shape[-1]
    positions = torch.arange(1, num_actions + 1, device=mask.device)  # (A,) 1-based
    last = (mask.bool().long() * positions).amax(dim=-1) - 1  # (B,) -1 for empty rows
    return torch.where(last < 0, torch.full_like(last, num_actions - 1), last)


def response_span(mask: torch.Tensor) -> torch.Tensor:
    """Columns from the first to the last valid one, inclusive, per row; 0 for an empty row.

    mask: (B, A) -> (B,) int64. OpenRLHF's response_length: it counts the gap columns of a
    multi-turn row (environment tokens between turns), which the count of valid columns skips.
    """
    valid = mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(valid)  # (B, A)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=-1)  # (B,)
    first = torch.where(valid, positions, torch.full_like(positions, mask.shape[-1])).amin(dim=-1)
    return torch.where(valid.any(dim=-1), last - first + 1, torch.zeros_like(last))
