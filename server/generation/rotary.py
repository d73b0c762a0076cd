"""Rotary position embedding from a cos/sin table built once by the HF model's own module.

Calling the model's rotary embedding for every position once gives exactly the values its
forward computes per batch (the table is element-wise in the position), so every rope-scaling
type HF implements for a fixed length (default, linear, llama3, yarn, ...) comes for free.
Length-dependent types are refused in families.py.
"""

from __future__ import annotations

import torch

__all__ = ["RopeTable", "apply_rope"]


class RopeTable:
    """cos and sin (N, D) in the model dtype for positions 0 .. N - 1."""

    def __init__(self, rotary: torch.nn.Module, positions: int, dtype: torch.dtype) -> None:
        device = next(rotary.buffers()).device
        probe = torch.empty(0, dtype=dtype, device=device)  # gives the forward its dtype
        with torch.inference_mode():
            cos, sin = rotary(probe, torch.arange(positions, device=device)[None])
        # Clones leave inference mode's tensors behind so compiled and captured code can use them.
        self.cos = cos[0].clone()  # (N, D)
        self.sin = sin[0].clone()

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (*positions.shape, D) for a tensor of position ids."""
        return self.cos[positions], self.sin[positions]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, s, heads, D) rotated by cos/sin (b, s, D), as HF's apply_rotary_pos_emb, on the
    projections' token-major layout: compiled, the output stays token-major (rotating the
    heads-first view wrote transposed: 5 ms of a scoring forward batch on an H100)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    return x * cos + _rotate_half(x) * sin
