"""The tensor fields of an Experience: name, per-row axis and dtype, in proto order.

Code that touches every field (validation, the wire, batching, slicing rows) loops over these
specs, so a new field is one row here plus its dataclass attribute in records.py.
Shapes: B rows, S = P + A token columns, A action columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "EXPERIENCE_ACTION_FIELDS",
    "EXPERIENCE_SEQUENCE_FIELDS",
    "EXPERIENCE_SPECS",
    "EXPERIENCE_TENSOR_FIELDS",
    "INDEX_SPECS",
    "STEP_SPECS",
    "FieldSpec",
]


@dataclass(frozen=True)
class FieldSpec:
    """One tensor field of Experience: the per-row axis it has ("S", "A" or none) and its dtype."""

    name: str
    axis: str  # "S": (.., S) sequence axis; "A": (.., A) action axis; "": one value per row
    dtype: torch.dtype
    optional: bool = False


# Tensor fields shared by Experience (with a leading B) and BufferItem, in proto order (the
# per-row indices below sit between action_entropy and rollout_log_probs on the wire).
STEP_SPECS: tuple[FieldSpec, ...] = (
    FieldSpec("sequences", "S", torch.int64),
    FieldSpec("attention_mask", "S", torch.bool),
    FieldSpec("action_mask", "A", torch.bool),
    FieldSpec("action_log_probs", "A", torch.float32),
    FieldSpec("base_action_log_probs", "A", torch.float32, optional=True),
    FieldSpec("values", "A", torch.float32, optional=True),
    FieldSpec("reward", "", torch.float32),
    FieldSpec("kl", "A", torch.float32),
    FieldSpec("advantages", "A", torch.float32),
    FieldSpec("returns", "A", torch.float32),
    FieldSpec("action_entropy", "A", torch.float32, optional=True),
    FieldSpec("rollout_log_probs", "A", torch.float32, optional=True),
)
# Per-row indices: (B,) int64 tensors on an Experience, plain ints on a BufferItem.
INDEX_SPECS: tuple[FieldSpec, ...] = (
    FieldSpec("policy_version", "", torch.int64),
    FieldSpec("prompt_index", "", torch.int64),
)
EXPERIENCE_SPECS = STEP_SPECS + INDEX_SPECS

# The names of Experience's per-row tensor fields (optional ones included), read from the specs
# above so that code touching every field (slicing rows, trimming columns) cannot miss a new one.
EXPERIENCE_TENSOR_FIELDS: tuple[str, ...] = tuple(spec.name for spec in EXPERIENCE_SPECS)
# Those shaped (B, S): one column per token.
EXPERIENCE_SEQUENCE_FIELDS: tuple[str, ...] = tuple(
    spec.name for spec in EXPERIENCE_SPECS if spec.axis == "S"
)
# Those shaped (B, A): one column per action.
EXPERIENCE_ACTION_FIELDS: tuple[str, ...] = tuple(
    spec.name for spec in EXPERIENCE_SPECS if spec.axis == "A"
)
