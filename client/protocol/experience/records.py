"""Experience (one micro-batch as torch tensors) and BufferItem (one of its rows), with the checks
that every field agrees with B, S and A and has the wire's dtype.

Shapes: B rows, S = P + A token columns, A action columns; action column j refers to token
P + j (see the row layout at the top of rollout.proto: prompts left-padded, responses
right-padded, prefix action masks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import InvalidArgument
from .fields import EXPERIENCE_SPECS, INDEX_SPECS, STEP_SPECS

__all__ = ["BufferItem", "Experience"]


@dataclass(frozen=True, eq=False, kw_only=True)
class Experience:
    """One micro-batch of experience; shapes and dtypes are checked on construction.

    Dtypes are the wire's: sequences and indices int64, masks bool, every float float32.
    Equality is identity (tensors have no single truth value); compare fields instead.
    """

    sequences: torch.Tensor  # (B, S) prompt + response token ids
    attention_mask: torch.Tensor  # (B, S) true on real tokens
    action_mask: torch.Tensor  # (B, A) true on valid response tokens
    action_log_probs: torch.Tensor  # (B, A) re-scored by the actor after generation
    base_action_log_probs: torch.Tensor | None = None  # (B, A) without a reference model: None
    values: torch.Tensor | None = None  # (B, A) without a critic: None
    reward: torch.Tensor  # (B,)
    kl: torch.Tensor  # (B, A)
    advantages: torch.Tensor  # (B, A)
    returns: torch.Tensor  # (B, A)
    action_entropy: torch.Tensor | None = None  # (B, A) only when requested
    # (B, A) behaviour log-probs recorded while sampling; None from servers that predate them
    rollout_log_probs: torch.Tensor | None = None
    info: dict[str, torch.Tensor] = field(default_factory=dict)  # each (B, ...)
    policy_version: torch.Tensor  # (B,) int64
    prompt_index: torch.Tensor  # (B,) int64
    response_texts: tuple[str, ...] | None = None  # B strings when requested

    def __post_init__(self) -> None:
        # Own copies, so that the caller's later edits cannot bypass the checks below.
        object.__setattr__(self, "info", dict(self.info))
        if self.response_texts is not None:
            object.__setattr__(self, "response_texts", tuple(self.response_texts))
        _check_experience(self)

    @property
    def num_rows(self) -> int:
        return self.sequences.shape[0]

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[1]

    @property
    def prompt_width(self) -> int:
        return self.sequences.shape[1] - self.action_mask.shape[1]

    def to_device(self, device: torch.device | str, non_blocking: bool = False) -> Experience:
        """A new Experience with every tensor (info included) on `device`."""
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Experience:
        """A new Experience with its CPU tensors in pinned memory, ready for async `.to(cuda)`.

        Without CUDA there is nothing to pin for: this returns `self` unchanged, so trainers
        can call it unconditionally.
        """
        if not torch.cuda.is_available():
            return self
        return self._map_tensors(lambda t: t.pin_memory() if t.device.type == "cpu" else t)

    def _map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Experience:
        changes = {
            spec.name: fn(t)
            for spec in EXPERIENCE_SPECS
            if (t := getattr(self, spec.name)) is not None
        }
        info = {key: fn(t) for key, t in self.info.items()}
        return dataclasses.replace(self, **changes, info=info)


@dataclass(frozen=True, eq=False, kw_only=True)
class BufferItem:
    """One row of an Experience: the same fields with the batch dimension removed."""

    sequences: torch.Tensor  # (S,)
    attention_mask: torch.Tensor  # (S,)
    action_mask: torch.Tensor  # (A,)
    action_log_probs: torch.Tensor  # (A,)
    base_action_log_probs: torch.Tensor | None = None  # (A,)
    values: torch.Tensor | None = None  # (A,)
    reward: torch.Tensor  # () 0-dim
    kl: torch.Tensor  # (A,)
    advantages: torch.Tensor  # (A,)
    returns: torch.Tensor  # (A,)
    action_entropy: torch.Tensor | None = None  # (A,)
    rollout_log_probs: torch.Tensor | None = None  # (A,)
    info: dict[str, torch.Tensor] = field(default_factory=dict)  # each the row's slice
    policy_version: int
    prompt_index: int
    response_text: str | None = None

    def __post_init__(self) -> None:
        _check_item(self)

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[0]


# ---- validation ----------------------------------------------------------------------------------


def _check_tensor(
    t: object, shape: tuple[int, ...], dims: str, dtype: torch.dtype, name: str
) -> None:
    """InvalidArgument naming `name` unless `t` is a tensor of `shape` and `dtype`."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{name}: expected a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise InvalidArgument(f"{name}: expected shape {dims} = {shape}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise InvalidArgument(f"{name}: expected dtype {dtype}, got {t.dtype}")


def _check_rank(t: object, ndim: int, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.ndim != ndim:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise InvalidArgument(f"{name}: expected a {ndim}-dim tensor, got {got}")


def _check_experience(e: Experience) -> None:
    """Every field agrees with B, S, A and has the documented dtype."""
    _check_rank(e.sequences, 2, "experience.sequences")
    _check_rank(e.action_mask, 2, "experience.action_mask")
    (b, s), a = e.sequences.shape, e.action_mask.shape[1]
    if a > s:
        raise InvalidArgument(f"experience: {a} action columns exceed the {s} token columns")
    shapes = {"S": ((b, s), "(B, S)"), "A": ((b, a), "(B, A)"), "": ((b,), "(B,)")}
    for spec in EXPERIENCE_SPECS:
        t = getattr(e, spec.name)
        if t is None and spec.optional:
            continue
        if t is None:
            raise InvalidArgument(f"experience.{spec.name} is required")
        _check_tensor(t, *shapes[spec.axis], spec.dtype, f"experience.{spec.name}")
    for key, t in e.info.items():
        if not isinstance(t, torch.Tensor) or t.ndim == 0 or t.shape[0] != b:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgument(
                f"experience.info[{key!r}]: expected leading dim B = {b}, got {got}"
            )
    texts = e.response_texts
    if texts is not None and (len(texts) != b or not all(isinstance(x, str) for x in texts)):
        raise InvalidArgument(f"experience.response_texts: expected None or B = {b} strings")


def _check_item(item: BufferItem) -> None:
    """The row's own fields agree with its S and A (so padding cannot misalign them)."""
    _check_rank(item.sequences, 1, "buffer_item.sequences")
    _check_rank(item.action_mask, 1, "buffer_item.action_mask")
    s, a = item.sequences.shape[0], item.action_mask.shape[0]
    if a > s:
        raise InvalidArgument(f"buffer_item: {a} action columns exceed the {s} token columns")
    shapes = {"S": ((s,), "(S,)"), "A": ((a,), "(A,)"), "": ((), "()")}
    for spec in STEP_SPECS:
        t = getattr(item, spec.name)
        if t is None and spec.optional:
            continue
        _check_tensor(t, *shapes[spec.axis], spec.dtype, f"buffer_item.{spec.name}")
    for spec in INDEX_SPECS:
        if not isinstance(getattr(item, spec.name), int):
            raise InvalidArgument(f"buffer_item.{spec.name}: expected an int")
