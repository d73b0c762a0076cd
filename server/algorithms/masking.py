"""Masked reductions over the action axis, shared by the KL, reward and advantage functions,
and the action-mask rules that derive a row's masks from its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ACTION_MASK_RULES",
    "ProcessedSequences",
    "float_dtype",
    "last_valid_column",
    "masked_row_mean",
    "process_sequences",
    "response_span",
]

# "stop": the generator's mask (through the first stop sequence; every token of a truncated
# row). "process_sequences": LightRFT's post-hoc derivation from the tokens (process_sequences).
ACTION_MASK_RULES = ("stop", "process_sequences")


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


@dataclass(frozen=True)
class ProcessedSequences:
    """Rows after LightRFT's process_sequences. B rows, S = P + A token columns."""

    sequences: torch.Tensor  # (B, S) int64, EOS written at each row's end
    attention_mask: torch.Tensor  # (B, S) bool, from the first real token to the EOS
    action_mask: torch.Tensor  # (B, A) bool, by the state token; column 0 always true
    response_lengths: torch.Tensor  # (B,) int64, action columns through the last valid one


def process_sequences(
    sequences: torch.Tensor,
    prompt_width: int,
    eos_token_id: int,
    pad_token_id: int,
    *,
    eos_over_last_token: bool = False,
) -> ProcessedSequences:
    """LightRFT's (and OpenRLHF's former Actor's) masks of generated rows, from the tokens alone.

    sequences (B, S): prompts left-padded to prompt_width P, responses right-padded.
    A token is real when it is neither eos_token_id nor pad_token_id. Per row
    (docs/reference/experience_math.md, section 3.1): e = S - max(k, 1), where k counts the
    columns right of the last real token (0 for a row without one); EOS is written at e; the
    attention mask is true from the first real token to e; action column j is valid when its
    state token sequences[P - 1 + j] is real, and column 0 always is. So the final EOS is an
    action and EOS tokens inside the prompt stay attended.

    A row whose last column holds a real token (truncated at the batch's width) has no room
    for its EOS: upstream writes it over that token, an action the model never sampled;
    here the token is kept unless eos_over_last_token (QUIRKS "eos_overwrites_last_token").
    The masks are the same either way: column e is no state of any action.
    """
    width = sequences.shape[1]  # S
    if not 1 <= prompt_width <= width:
        raise ValueError(f"prompt_width must lie in [1, {width}], got {prompt_width}")
    real = (sequences != eos_token_id) & (sequences != pad_token_id)  # (B, S)
    # argmax returns the first maximal index, so on a row without a real token both are 0.
    right_of_last = real.long().flip(1).argmax(dim=1)  # (B,) k
    eos_index = width - right_of_last.clamp(min=1)  # (B,) e
    at_eos = sequences.gather(1, eos_index[:, None])  # (B, 1)
    write = torch.ones_like(at_eos, dtype=torch.bool)
    if not eos_over_last_token:
        write = ~real.gather(1, eos_index[:, None])  # only over an EOS or a pad
    written = sequences.scatter(1, eos_index[:, None], torch.where(write, eos_token_id, at_eos))
    first_real = real.long().argmax(dim=1)  # (B,)
    positions = torch.arange(width, device=sequences.device)  # (S,)
    attention = (positions >= first_real[:, None]) & (positions <= eos_index[:, None])  # (B, S)
    states = written[:, prompt_width - 1 : width - 1]  # (B, A): the token left of each action
    action_mask = (states != eos_token_id) & (states != pad_token_id)
    if action_mask.shape[1] > 0:
        action_mask[:, 0] = True
    columns = torch.arange(1, action_mask.shape[1] + 1, device=sequences.device)  # (A,) 1-based
    last = action_mask.long() * columns  # (B, A)
    response_lengths = last.amax(dim=1) if last.shape[1] else last.sum(dim=1)  # (B,)
    return ProcessedSequences(written, attention, action_mask, response_lengths)
