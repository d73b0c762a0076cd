"""Experience (one micro-batch, the proto's Experience as torch tensors) and its buffer rows.

Shapes: B rows, S = P + A token columns, A action columns; action column j refers to token
P + j (see the row layout at the top of rollout.proto: prompts left-padded, responses
right-padded, prefix action masks). Batches built here keep that layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from rollserve.client.codec import decode_optional, decode_tensor, encode_tensor_into
from rollserve.client.errors import InvalidArgument
from rollserve.v1 import rollout_pb2 as pb

__all__ = [
    "EXPERIENCE_ACTION_FIELDS",
    "EXPERIENCE_SEQUENCE_FIELDS",
    "EXPERIENCE_TENSOR_FIELDS",
    "Experience",
    "BufferItem",
    "experience_to_proto",
    "experience_from_proto",
    "split_experience_batch",
    "make_experience_batch",
    "concat_experiences",
]


@dataclass(frozen=True)
class _Spec:
    """One tensor field: the per-row axis it has ("S", "A" or none) and its dtype."""

    name: str
    axis: str  # "S": (.., S) sequence axis; "A": (.., A) action axis; "": one value per row
    dtype: torch.dtype
    optional: bool = False


# Tensor fields shared by Experience (with a leading B) and BufferItem, in proto order.
_STEP_SPECS: tuple[_Spec, ...] = (
    _Spec("sequences", "S", torch.int64),
    _Spec("attention_mask", "S", torch.bool),
    _Spec("action_mask", "A", torch.bool),
    _Spec("action_log_probs", "A", torch.float32),
    _Spec("base_action_log_probs", "A", torch.float32, optional=True),
    _Spec("values", "A", torch.float32, optional=True),
    _Spec("reward", "", torch.float32),
    _Spec("kl", "A", torch.float32),
    _Spec("advantages", "A", torch.float32),
    _Spec("returns", "A", torch.float32),
    _Spec("action_entropy", "A", torch.float32, optional=True),
)
# Per-row indices: (B,) int64 tensors on an Experience, plain ints on a BufferItem.
_INDEX_SPECS: tuple[_Spec, ...] = (
    _Spec("policy_version", "", torch.int64),
    _Spec("prompt_index", "", torch.int64),
)
_EXPERIENCE_SPECS = _STEP_SPECS + _INDEX_SPECS

# The names of Experience's per-row tensor fields (optional ones included), read from the specs
# above so that code touching every field (slicing rows, trimming columns) cannot miss a new one.
EXPERIENCE_TENSOR_FIELDS: tuple[str, ...] = tuple(spec.name for spec in _EXPERIENCE_SPECS)
# Those shaped (B, S): one column per token.
EXPERIENCE_SEQUENCE_FIELDS: tuple[str, ...] = tuple(
    spec.name for spec in _EXPERIENCE_SPECS if spec.axis == "S"
)
# Those shaped (B, A): one column per action.
EXPERIENCE_ACTION_FIELDS: tuple[str, ...] = tuple(
    spec.name for spec in _EXPERIENCE_SPECS if spec.axis == "A"
)


@dataclass(frozen=True, eq=False, kw_only=True)
class Experience:
    """One micro-batch of experience; shapes and dtypes are checked on construction.

    Dtypes are the wire's: sequences and indices int64, masks bool, every float float32.
    Equality is identity (tensors have no single truth value); compare fields instead.
    """

    sequences: torch.Tensor  # (B, S) prompt + response token ids
    attention_mask: torch.Tensor  # (B, S) true on real tokens
    action_mask: torch.Tensor  # (B, A) true on valid response tokens
    action_log_probs: torch.Tensor  # (B, A)
    base_action_log_probs: torch.Tensor | None = None  # (B, A) without a reference model: None
    values: torch.Tensor | None = None  # (B, A) without a critic: None
    reward: torch.Tensor  # (B,)
    kl: torch.Tensor  # (B, A)
    advantages: torch.Tensor  # (B, A)
    returns: torch.Tensor  # (B, A)
    action_entropy: torch.Tensor | None = None  # (B, A) only when requested
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
            for spec in _EXPERIENCE_SPECS
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
    info: dict[str, torch.Tensor] = field(default_factory=dict)  # each the row's slice
    policy_version: int
    prompt_index: int
    response_text: str | None = None

    def __post_init__(self) -> None:
        _check_item(self)

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[0]


# ------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------


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
    for spec in _EXPERIENCE_SPECS:
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
    for spec in _STEP_SPECS:
        t = getattr(item, spec.name)
        if t is None and spec.optional:
            continue
        _check_tensor(t, *shapes[spec.axis], spec.dtype, f"buffer_item.{spec.name}")
    for spec in _INDEX_SPECS:
        if not isinstance(getattr(item, spec.name), int):
            raise InvalidArgument(f"buffer_item.{spec.name}: expected an int")


# ------------------------------------------------------------------------------------------
# Wire
# ------------------------------------------------------------------------------------------


def experience_to_proto(e: Experience) -> pb.Experience:
    """The wire form of `e`; None fields stay unset."""
    msg = pb.Experience()
    for spec in _EXPERIENCE_SPECS:
        t = getattr(e, spec.name)
        if t is not None:
            encode_tensor_into(getattr(msg, spec.name), t, name=f"experience.{spec.name}")
    for key, t in e.info.items():
        encode_tensor_into(msg.info[key], t, name=f"experience.info[{key!r}]")
    if e.response_texts is not None:
        msg.response_texts.extend(e.response_texts)
    return msg


def experience_from_proto(msg: pb.Experience) -> Experience:
    """Decode and validate; TensorCodecError / InvalidArgument name the offending field."""
    tensors: dict[str, torch.Tensor | None] = {}
    for spec in _EXPERIENCE_SPECS:
        name = f"experience.{spec.name}"
        t = decode_optional(msg, spec.name, name=name)
        if t is None and not spec.optional:
            raise InvalidArgument(f"{name} is required")
        tensors[spec.name] = t
    # Sorted: map order on the wire is unspecified, a stable order makes results reproducible.
    info = {
        key: decode_tensor(msg.info[key], name=f"experience.info[{key!r}]")
        for key in sorted(msg.info)
    }
    texts = tuple(msg.response_texts) or None  # repeated strings: "none sent" reads as empty
    return Experience(**tensors, info=info, response_texts=texts)


# ------------------------------------------------------------------------------------------
# Buffer rows
# ------------------------------------------------------------------------------------------


def split_experience_batch(e: Experience) -> list[BufferItem]:
    """One BufferItem per row: every field unbound along dim 0, nothing stripped (ColossalChat).

    Items are views into `e`'s tensors (no copy), so they keep its storage alive.
    """
    b = e.num_rows
    columns = {
        spec.name: (t.unbind(0) if (t := getattr(e, spec.name)) is not None else (None,) * b)
        for spec in _STEP_SPECS
    }
    info_rows = {key: t.unbind(0) for key, t in e.info.items()}
    versions = e.policy_version.tolist()
    prompt_indices = e.prompt_index.tolist()
    texts = e.response_texts if e.response_texts is not None else (None,) * b
    return [
        BufferItem(
            **{name: rows[i] for name, rows in columns.items()},
            info={key: rows[i] for key, rows in info_rows.items()},
            policy_version=versions[i],
            prompt_index=prompt_indices[i],
            response_text=texts[i],
        )
        for i in range(b)
    ]


def make_experience_batch(items: Sequence[BufferItem], pad_token_id: int = 0) -> Experience:
    """Stack items into one Experience in the wire layout of rollout.proto (as the server does).

    With P_i = S_i - A_i an item's prompt part is its first P_i tokens and its response part its
    last A_i. The batch has P = max(P_i) and A = max(A_i), S = P + A: each row's prompt part is
    LEFT-padded to P (sequences with `pad_token_id`, the attention mask with False), its response
    part and every action-axis field are RIGHT-padded to A (masks False, floats 0), and per-row
    scalars are stacked. So action column j <-> token P + j in every row and the action mask
    stays a prefix mask.

    Why not ColossalChat's rule: it left-pads only the action fields (action column j <-> one
    of the last A tokens), which for items of different widths turns prefix masks into suffix
    masks and stops responses from being right-padded. Keeping the wire layout instead means a
    trainer sees one layout whether a batch came from the server or from its replay buffer.
    Items of one batch have equal widths, so this inverts `split_experience_batch` bit for bit.

    Info tensors whose first per-row dim equals each item's A are right-padded like action
    fields; others must agree in shape and are stacked. Optional fields, info keys and
    response texts must be present in all items or in none (InvalidArgument otherwise).
    """
    if not items:
        raise InvalidArgument("make_experience_batch: no items")
    _check_same_presence(items)
    prompt_widths = [item.sequences.shape[0] - item.num_actions for item in items]
    width_p, width_a = max(prompt_widths), max(item.num_actions for item in items)
    # A row's tokens are contiguous (prompt part then response part), so one shift places both:
    # its prompt part ends at column P and its response part starts there.
    starts = {"S": [width_p - p_i for p_i in prompt_widths], "A": [0] * len(items)}
    widths = {"S": width_p + width_a, "A": width_a}
    fields: dict[str, torch.Tensor | None] = {}
    for spec in _STEP_SPECS:
        rows = [getattr(item, spec.name) for item in items]
        if rows[0] is None:
            fields[spec.name] = None
        elif spec.axis:
            fill = pad_token_id if spec.name == "sequences" else 0
            fields[spec.name] = _place_rows(rows, widths[spec.axis], starts[spec.axis], fill)
        else:
            fields[spec.name] = torch.stack(rows)  # (B,)
    device = items[0].sequences.device
    for spec in _INDEX_SPECS:
        values = [getattr(item, spec.name) for item in items]
        fields[spec.name] = torch.tensor(values, dtype=spec.dtype, device=device)  # (B,)
    info = {key: _batch_info(key, items, width_a) for key in items[0].info}
    texts = None if items[0].response_text is None else tuple(i.response_text for i in items)
    return Experience(**fields, info=info, response_texts=texts)  # type: ignore[arg-type]


def concat_experiences(experiences: Sequence[Experience], pad_token_id: int = 0) -> Experience:
    """Join micro-batches (e.g. one streamed response) row by row into one wire-layout Experience.

    Same as `make_experience_batch` over the split rows of each experience, in order.
    """
    if not experiences:
        raise InvalidArgument("concat_experiences: no experiences")
    items = [item for e in experiences for item in split_experience_batch(e)]
    return make_experience_batch(items, pad_token_id=pad_token_id)


def _check_same_presence(items: Sequence[BufferItem]) -> None:
    first = items[0]
    for index, item in enumerate(items):
        for spec in _STEP_SPECS:
            if (getattr(item, spec.name) is None) != (getattr(first, spec.name) is None):
                raise InvalidArgument(
                    f"items[{index}].{spec.name}: present in some items and absent in others"
                )
        if item.info.keys() != first.info.keys():
            raise InvalidArgument(
                f"items[{index}].info: keys {sorted(item.info)} differ from {sorted(first.info)}"
            )
        if (item.response_text is None) != (first.response_text is None):
            raise InvalidArgument(
                f"items[{index}].response_text: present in some items and absent in others"
            )


def _place_rows(
    rows: Sequence[torch.Tensor], width: int, starts: Sequence[int], fill: int
) -> torch.Tensor:
    """Stack rows (n_i, *rest) into (len(rows), width, *rest): row i fills columns
    [starts[i], starts[i] + n_i), `fill` elsewhere."""
    first = rows[0]
    if all(row.shape[0] == width for row in rows):
        return torch.stack(list(rows))  # nothing to pad: every start is 0
    out = first.new_full((len(rows), width, *first.shape[1:]), fill)
    for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
        out[i, start : start + row.shape[0]] = row
    return out


def _batch_info(key: str, items: Sequence[BufferItem], width_a: int) -> torch.Tensor:
    """Batch one info key: right-pad along an action axis, else stack equal shapes."""
    rows = [item.info[key] for item in items]
    name = f"info[{key!r}]"
    if any(row.dtype != rows[0].dtype for row in rows):
        raise InvalidArgument(f"{name}: dtypes differ across items")
    rest_agrees = all(row.shape[1:] == rows[0].shape[1:] for row in rows)
    has_action_axis = all(
        row.ndim >= 1 and row.shape[0] == item.num_actions
        for row, item in zip(rows, items, strict=True)
    )
    if has_action_axis and rest_agrees:
        return _place_rows(rows, width_a, [0] * len(rows), 0)  # (B, A, ...)
    if all(row.shape == rows[0].shape for row in rows):
        return torch.stack(rows)  # (B, ...)
    shapes = [tuple(row.shape) for row in rows]
    raise InvalidArgument(
        f"{name}: per-row shapes {shapes} neither agree nor follow each item's action width"
    )
