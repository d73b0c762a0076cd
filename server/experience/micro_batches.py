"""Cutting shaped rows into the micro-batches a request streams: whole groups, tight widths.

Rows arrive a generation batch at a time, each batch as one Experience in its own layout.
MicroBatcher hands them out as micro-batches of exactly `rows` rows (the last may have fewer):
rows left over at the end of one generation batch wait for the next one, so the stream carries
exactly ExperienceSpec.num_micro_batches messages whatever the generation batch size. `rows` is
a multiple of the group size and so is every generation batch, so a group is never split.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from ...client.protocol.experience import (
    EXPERIENCE_ACTION_FIELDS,
    EXPERIENCE_SEQUENCE_FIELDS,
    EXPERIENCE_TENSOR_FIELDS,
    Experience,
    concat_experiences,
)

__all__ = ["MicroBatcher", "select_rows", "tight"]


class MicroBatcher:
    """Rows made but not streamed yet; hands them out as micro-batches of exactly `rows` rows.

    A micro-batch that spans two generation batches is joined with concat_experiences (wire
    layout); each one is trimmed to its own tight width.
    """

    def __init__(self, rows: int, pad_token_id: int) -> None:
        self.rows = rows
        self.pad_token_id = pad_token_id
        self.parts: list[Experience] = []
        self.count = 0

    def add(self, experience: Experience) -> Iterator[Experience]:
        """Take the rows of one generation batch; yield every micro-batch now complete."""
        self.parts.append(experience)
        self.count += experience.num_rows
        while self.count >= self.rows:
            yield self._take(self.rows)

    def flush(self) -> Iterator[Experience]:
        """The last, shorter micro-batch, if rows are left."""
        if self.count:
            yield self._take(self.count)

    def _take(self, rows: int) -> Experience:
        taken: list[Experience] = []
        while rows:
            part = self.parts[0]
            if part.num_rows <= rows:  # the whole part fits
                taken.append(tight(self.parts.pop(0)))
                rows -= part.num_rows
                self.count -= part.num_rows
                continue
            taken.append(tight(select_rows(part, slice(0, rows))))
            self.parts[0] = select_rows(part, slice(rows, None))
            self.count -= rows
            rows = 0
        if len(taken) == 1:
            return taken[0]
        return concat_experiences(taken, pad_token_id=self.pad_token_id)


def select_rows(e: Experience, rows: slice) -> Experience:
    """Rows of an Experience (views)."""
    changes: dict[str, object] = {}
    for name in EXPERIENCE_TENSOR_FIELDS:
        value = getattr(e, name)
        changes[name] = None if value is None else value[rows]
    changes["info"] = {key: value[rows] for key, value in e.info.items()}
    changes["response_texts"] = None if e.response_texts is None else e.response_texts[rows]
    return replace(e, **changes)


def tight(e: Experience) -> Experience:
    """Trim the columns no row uses: the common left pad of the prompts and the common right
    pad of the responses (read from the attention mask, which is true on every real token)."""
    mask = e.attention_mask  # (B, S)
    width = e.prompt_width
    width_p = int(mask[:, :width].sum(-1).max())  # longest prompt
    width_a = int(mask[:, width:].sum(-1).max())  # longest response (>= 1 token per row)
    # Token columns keep the longest prompt and response; action columns the longest response.
    # Per-row fields (reward, indices) have no columns to trim.
    columns = dict.fromkeys(EXPERIENCE_SEQUENCE_FIELDS, slice(width - width_p, width + width_a))
    columns.update(dict.fromkeys(EXPERIENCE_ACTION_FIELDS, slice(0, width_a)))
    changes: dict[str, object] = {}
    for name, kept in columns.items():
        value = getattr(e, name)
        changes[name] = None if value is None else value[:, kept].contiguous()
    actions = e.num_actions
    changes["info"] = {
        key: value[:, :width_a].contiguous()
        if value.ndim >= 2 and value.shape[1] == actions
        else value.contiguous()
        for key, value in e.info.items()
    }
    return replace(e, **changes)
