"""Rows in and out of batches: split an Experience into BufferItems, stack items (or join
micro-batches) back into one Experience in the wire layout of rollout.proto.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InvalidArgument
from .fields import INDEX_SPECS, STEP_SPECS
from .records import BufferItem, Experience

__all__ = [
    "check_same_presence",
    "concat_experiences",
    "make_experience_batch",
    "split_experience_batch",
]


def split_experience_batch(e: Experience) -> list[BufferItem]:
    """One BufferItem per row: every field unbound along dim 0, nothing stripped (ColossalChat).

    Items are views into `e`'s tensors (no copy), so they keep its storage alive.
    """
    b = e.num_rows
    columns = {
        spec.name: (t.unbind(0) if (t := getattr(e, spec.name)) is not None else (None,) * b)
        for spec in STEP_SPECS
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
    check_same_presence(items)
    prompt_widths = [item.sequences.shape[0] - item.num_actions for item in items]
    width_p, width_a = max(prompt_widths), max(item.num_actions for item in items)
    # A row's tokens are contiguous (prompt part then response part), so one shift places both:
    # its prompt part ends at column P and its response part starts there.
    starts = {"S": [width_p - p_i for p_i in prompt_widths], "A": [0] * len(items)}
    widths = {"S": width_p + width_a, "A": width_a}
    fields: dict[str, torch.Tensor | None] = {}
    for spec in STEP_SPECS:
        rows = [getattr(item, spec.name) for item in items]
        if rows[0] is None:
            fields[spec.name] = None
        elif spec.axis:
            fill = pad_token_id if spec.name == "sequences" else 0
            fields[spec.name] = _place_rows(rows, widths[spec.axis], starts[spec.axis], fill)
        else:
            fields[spec.name] = torch.stack(rows)  # (B,)
    device = items[0].sequences.device
    for spec in INDEX_SPECS:
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


def check_same_presence(items: Sequence[BufferItem]) -> None:
    """InvalidArgument unless every item holds the same optional fields and info keys as the
    first (a batch is built field by field)."""
    first = items[0]
    for index, item in enumerate(items):
        for spec in STEP_SPECS:
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
